"""Exports of smoke drafts for the consumer tests, and the JAX draft's outputs on fixed inputs.

Each export is a smoke run's checkpoint with large random parameters (norm scales 1 +- 0.2, the rest
N(0, 0.3^2): the Markov term and the confidence logit are of the base logits' size, so a mismatch in
either cannot hide, as it does in a few-step draft whose Markov term is ~1% of its logits), exported with
`export --for=all` (the baseline), `--baseline_part` (Draft Memory) or with a draft vocabulary.

A consumer test runs the consumer's own code in a subprocess (`run_consumer`): its script
(`tests/interop/consumer_<name>.py DIRECTORY INPUTS OUTPUTS`) loads the consumer's directory with the
consumer's loader, picks the target's states by the consumer's own layer convention from `hidden` (the
target's states as transformers' `output_hidden_states` lists them: [0] the embedding output, [k + 1]
layer k's output), runs the consumer's forward on the blocks of `anchors`, and writes `base`, `markov`,
`confidence` and the `predecessors` it used; `compare` holds them to the JAX draft's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import baseline, memory
from dspark_jax import sharding
from dspark_jax.interop import consumers
from dspark_jax.run import draft_state, target_side
from dspark_jax.run.deepspec_checkpoint import export_draft
from dspark_jax.target import target_from_config
from tests.references import reference_package_dir
from tests.test_export import _save_run

ROOT = Path(__file__).resolve().parents[2]
MASK_ROW = 3
DRAFT_VOCAB = 256
RTOL = 1e-5  # of each output's largest magnitude


@dataclasses.dataclass
class Export:
    """An exported draft (`directory`), its config and the JAX draft's outputs on the fixed inputs."""

    directory: Path
    config: object
    inputs: dict[str, np.ndarray]  # input_ids [B, T], hidden [B, L + 1, T, H], anchors [B, N]
    want: dict[
        str, np.ndarray
    ]  # base / markov / markov_shifted [B, N, S, V or K], confidence / predecessors [B, N, S]


def _inputs(config, side, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    b, t, layers, h = 2, 40, side.config.num_layers, side.config.hidden_size
    return {
        "input_ids": rng.integers(0, side.config.vocab_size, (b, t)).astype(np.int64),
        "hidden": rng.normal(size=(b, layers + 1, t, h)).astype(np.float32),
        "anchors": np.asarray([[0, 9, 21, 32], [4, 5, 17, 30]], np.int64),
    }


def reference(model, side, config, inputs, mesh) -> dict[str, np.ndarray]:
    """The JAX draft's base and Markov logits, confidence logits and predecessors (teacher forced)."""
    from dspark_jax.groups.baseline import block_states

    ids = jnp.asarray(inputs["input_ids"], jnp.int32)
    b, t = ids.shape
    aux = np.stack([inputs["hidden"][:, k + 1] for k in config.data.aux_layer_ids], axis=2)
    batch = {
        "input_ids": ids,
        "loss_mask": jnp.ones((b, t), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
        "aux_hidden": jnp.asarray(aux),
    }
    anchors = jnp.asarray(inputs["anchors"], jnp.int32)
    targets, h = block_states(model, side.frozen, batch, anchors, jnp.ones(anchors.shape))
    heads = model.heads(side.frozen, h, targets.predecessors)
    # A Markov predecessor off by one (slot i reading slot i - 2's token): a consumer test tells it apart.
    shifted = jnp.concatenate([targets.predecessors[..., :1], targets.predecessors[..., :-1]], axis=-1)
    out = {
        "base": model.base_logits(side.frozen, h),
        "markov": heads["logits"],
        "confidence": heads["confidence_logit"],
        "predecessors": targets.predecessors,
        "markov_shifted": model.heads(side.frozen, h, shifted)["logits"],
    }
    return {k: np.asarray(jax.device_get(v)) for k, v in out.items()}


def _smoke(group, root: Path, draft_vocab: int):
    config = group.get_config("smoke")
    config.draft.mask_token_id = MASK_ROW
    config.data.cache_dir = str(root / "caches")
    config.mesh.fsdp = 1
    config.train.draft_vocab = draft_vocab
    return config


def _baseline_part(model, root: Path, target_config, mesh):
    """A baseline draft holding `model`'s baseline parameters (a group's, by path): what its export runs."""
    graphdef, params, rest = draft_state.init_draft(_smoke(baseline, root, 0), target_config, mesh)
    own = {path: v.get_value() for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    params = nnx.from_flat_state([(p, v.replace(own[p])) for p, v in nnx.to_flat_state(params)])
    return nnx.merge(graphdef, params, rest)


def make_export(
    root: Path, group=baseline, *, draft_vocab: int = 0, consumers: str = "all", **kwargs
) -> Export:
    """A smoke run of `group` with large random parameters, exported to `root / 'out'`."""
    config = _smoke(group, root, draft_vocab)
    mesh = sharding.make_mesh(config.mesh.to_dict())
    target = target_from_config(config.target, seed=config.seed, mesh=mesh)
    side = target_side.side_from_target(target, mesh)
    if draft_vocab:  # the vocabulary ranks the training cache's tokens: build the smoke caches
        side, _ = target_side.prepare_target_side(config, mesh)
    # Another draw for each group: a baseline part equal to the baseline's would hide a mix-up of the two.
    seed = 0 if group is baseline else 2
    graphdef, params, rest = _save_run(config, root / "run", mesh, np.random.default_rng(seed))
    directory, _, _ = export_draft(config, root / "run", root / "out", consumers_text=consumers, **kwargs)
    model = nnx.merge(graphdef, params, rest)
    if group is not baseline:
        model = _baseline_part(model, root, target.config, mesh)
    inputs = _inputs(config, side)
    return Export(directory, config, inputs, reference(model, side, config, inputs, mesh))


def memory_export(root: Path) -> Export:
    return make_export(root, memory, baseline_part=True)


# The consumers' releases the tests run, installed without their dependencies (their pins would pull a CUDA
# build of torch): README's test command installs these, and `setup.cfg`'s `test` extra what they import.
CONSUMERS_INSTALL = "pip install --no-deps -r tests/interop/consumers.txt && pip install -e '.[test]'"


def run_consumer(
    name: str, directory: Path, inputs: dict[str, np.ndarray], tmp: Path
) -> dict[str, np.ndarray]:
    """Runs `tests/interop/consumer_<name>.py` on `directory` in a fresh interpreter; its outputs. A missing
    consumer package fails the test naming the install (`tests.references`)."""
    reference_package_dir(name, CONSUMERS_INSTALL)
    tmp.mkdir(parents=True, exist_ok=True)
    np.savez(tmp / "inputs.npz", **inputs)
    script = Path(__file__).with_name(f"consumer_{name}.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))} | {
        "PYTHONPATH": str(ROOT)
    }
    proc = subprocess.run(
        [sys.executable, str(script), str(directory), str(tmp / "inputs.npz"), str(tmp / "outputs.npz")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp,
    )
    if proc.returncode:
        raise AssertionError(f"{script.name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return dict(np.load(tmp / "outputs.npz"))


def differences(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> dict[str, float]:
    """Per output, the largest |got - want| over the largest |want| (predecessors: how many ids differ)."""
    out = {"predecessors": float(np.sum(got["predecessors"] != want["predecessors"]))}
    for name in ("base", "markov", "confidence"):
        out[name] = float(np.abs(got[name] - want[name]).max() / np.abs(want[name]).max())
    return out


def copy_for(export: Export, name: str, tmp: Path, edit=None) -> Path:
    """A copy of the directory consumer `name` reads of `export`, at `tmp`, `edit` applied to its config."""
    directory = Path(shutil.copytree(consumers.directory_of(export.directory, name), tmp))
    if edit:
        edit_config(directory, edit)
    return directory


def shift_layers(by: int):
    """A config edit moving `target_layer_ids` by `by` layers."""
    return lambda config: config.update(target_layer_ids=[i + by for i in config["target_layer_ids"]])


def edit_config(directory: Path, edit) -> None:
    """Rewrites `directory/config.json` with `edit(config)` applied (a broken copy's)."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config, indent=2))


def matches(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> bool:
    """The consumer's outputs are the JAX draft's: the same predecessors, every output within RTOL."""
    d = differences(got, want)
    return d["predecessors"] == 0 and max(d["base"], d["markov"], d["confidence"]) <= RTOL


def assert_matches(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert matches(got, want), differences(got, want)


def assert_differs(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """The consumer's base, Markov and confidence logits are each far (> 100 RTOL) from the JAX draft's."""
    d = differences(got, want)
    assert min(d["base"], d["markov"], d["confidence"]) > 100 * RTOL, d
