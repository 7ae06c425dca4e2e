"""Export to and import from DeepSpec's checkpoint layout, end to end through both commands.

A smoke baseline draft with random parameters is saved as a training checkpoint, exported with
`python -m dspark_jax.export`, imported back with `python -m dspark_jax.import_draft`: the parameters
come back bit for bit. The exported directory is then read by a float64 NumPy forward that knows only
DeepSpec's tensor names, its `config.json` keys and DeepSpec's formulas (`fc` + `hidden_norm` on the
context, q/k norms, RoPE, block attention over `[context j < a; own block]`, final `norm`, `lm_head`,
`markov_w2(markov_w1[t])`, `proj([h; markov_w1[t]])`), and reproduces the project's logits. Bad inputs
(a learned MASK, missing, mis-shaped or unknown tensors, a config that disagrees) fail with errors naming
the tensor or key, before anything is written. A group's own parameters and the serving engines' files:
`tests/test_serving_export.py`.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from configs import baseline, reranker_frozen
from dspark_jax.groups.baseline import block_states
from dspark_jax.interop import consumers
from dspark_jax.run import checkpoints, config_lib, draft_state, target_side
from dspark_jax.run import optimizer as optimizer_lib
from dspark_jax.run.checkpoints import Checkpointer
from dspark_jax.run.deepspec_checkpoint import export_draft, import_draft
from dspark_jax.target import TargetConfig, target_from_config
from dspark_jax.target.checkpoint import save_hf_checkpoint
from tests import compilation_cache
from tests.references import reference

ROOT = Path(__file__).resolve().parents[1]
MASK_ROW = 3
SMOKE_ARGS = [f"--config={ROOT}/configs/baseline.py:smoke", f"--config.draft.mask_token_id={MASK_ROW}"]


def _cli(tmp, module, *args):
    env = {
        **compilation_cache.ENV,
        "DSPARK_JAX_CACHE": str(tmp / "cache"),
        "JAX_PLATFORMS": "cpu",
        "PATH": "/usr/bin:/bin",
    }
    cmd = [sys.executable, "-m", f"dspark_jax.{module}", *args]
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    return proc, [line for line in proc.stderr.splitlines() if line.startswith("error: ")]


def _smoke_config(group=baseline, mask_row=MASK_ROW):
    config = group.get_config("smoke")
    config.draft.mask_token_id = mask_row
    return config


def _save_run(config, workdir, mesh, rng):
    """A training checkpoint (step 3, stored config) of a draft with large random parameters."""
    target = TargetConfig.from_json(config.target.arch.to_dict())
    graphdef, params, rest = draft_state.init_draft(config, target, mesh)
    flat = []
    for path, var in nnx.to_flat_state(params):
        value = var.get_value()
        noise = rng.normal(size=value.shape)
        new = 1.0 + 0.2 * noise if path[-1] == "scale" else 0.3 * noise
        flat.append((path, var.replace(jax.device_put(jnp.asarray(new, value.dtype), value.sharding))))
    params = nnx.from_flat_state(flat)
    _, optimizer = optimizer_lib.make_training_optimizer(config, params)
    state = {"params": params, "opt_state": jax.jit(optimizer.init)(params)}
    with Checkpointer(workdir / "checkpoints") as checkpointer:
        checkpointer.save(3, state, meta={"step": 3, "config": config_lib.to_stored(config)}, force=True)
    return graphdef, params, rest


def _host(params):
    return {path: np.asarray(var.get_value()) for path, var in nnx.to_flat_state(params)}


@pytest.fixture(scope="module")
def exported(tmp_path_factory, mesh8):
    """`(tmp, (graphdef, params, rest), export directory, imported work directory)`, through the CLIs."""
    tmp = tmp_path_factory.mktemp("deepspec")
    draft = _save_run(_smoke_config(), tmp / "run", mesh8, np.random.default_rng(0))
    proc, errors = _cli(tmp, "export", f"--checkpoint={tmp / 'run'}", f"--output={tmp / 'deepspec'}")
    assert proc.returncode == 0 and not errors, proc.stderr[-3000:]
    proc, errors = _cli(
        tmp, "import_draft", f"--input={tmp / 'deepspec'}", *SMOKE_ARGS, f"--workdir={tmp / 'in'}"
    )
    assert proc.returncode == 0 and not errors, proc.stderr[-3000:]
    return tmp, draft, tmp / "deepspec", tmp / "in"


@pytest.mark.slow
def test_export_then_import_is_bitwise_and_a_run(exported, mesh8):
    _, (_, params, _), _, imported = exported
    config = checkpoints.run_config(imported)  # what evaluate and speculate read
    assert config_lib.to_stored(config) == config_lib.to_stored(_smoke_config())
    target = TargetConfig.from_json(config.target.arch.to_dict())
    _, restored, _, step = draft_state.restore_draft(config, target, mesh8, imported)
    assert step == 0
    want, got = _host(params), _host(restored)
    assert want.keys() == got.keys()
    for path, value in want.items():
        assert got[path].dtype == value.dtype and np.array_equal(got[path], value), path
    with Checkpointer(imported / "checkpoints") as checkpointer:  # the full training state is there
        _, optimizer = optimizer_lib.make_training_optimizer(config, restored)
        state = {"params": restored, "opt_state": jax.jit(optimizer.init)(restored)}
        checkpointer.restore(0, draft_state.abstract_state(state, mesh8))


def test_config_json_is_deepspecs(exported):
    _, _, directory, _ = exported
    config_json = json.loads((directory / "config.json").read_text())
    smoke = _smoke_config()
    assert config_json["architectures"] == ["Qwen3DSparkModel"]
    assert {k: config_json[k] for k in ("num_hidden_layers", "num_target_layers", "block_size")} == {
        "num_hidden_layers": 3,
        "num_target_layers": smoke.target.arch.num_layers,
        "block_size": 7,
    }
    assert config_json["target_layer_ids"] == list(smoke.data.aux_layer_ids)
    assert (config_json["mask_token_id"], config_json["num_anchors"]) == (MASK_ROW, smoke.train.num_anchors)
    assert (config_json["markov_rank"], config_json["markov_head_type"]) == (
        smoke.draft.markov_rank,
        "vanilla",
    )
    assert config_json["enable_confidence_head"] is config_json["confidence_head_with_markov"] is True
    transformers = reference("transformers")
    hf = transformers.AutoConfig.from_pretrained(directory)  # a valid Qwen3 config for the draft's layers
    assert type(hf).__name__ == "Qwen3Config"
    assert (hf.num_hidden_layers, hf.head_dim, hf.num_key_value_heads) == (3, 16, 2)
    assert hf.layer_types == ["full_attention"] * 3 and not hf.attention_bias and not hf.tie_word_embeddings


def test_import_reads_a_bfloat16_sharded_directory(exported, mesh8):
    """DeepSpec trains in bf16 and transformers 5 writes RoPE as `rope_parameters` only: such a directory
    (here split into an index and shards) imports as the bf16 values, exactly, in float32."""
    tmp, (_, params, _), directory, _ = exported
    config_json = json.loads((directory / "config.json").read_text())
    del config_json["rope_theta"], config_json["rope_scaling"]
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in load_file(directory / "model.safetensors").items()}
    save_hf_checkpoint(tmp / "bf16", config_json, tensors, shard_size_bytes=4 << 20)
    assert (tmp / "bf16" / "model.safetensors.index.json").exists()
    config = _smoke_config()
    import_draft(config, tmp / "bf16", tmp / "bf16_run")
    target = TargetConfig.from_json(config.target.arch.to_dict())
    _, restored, _, _ = draft_state.restore_draft(config, target, mesh8, tmp / "bf16_run")
    want, got = _host(params), _host(restored)
    for path, value in want.items():
        rounded = value.astype(ml_dtypes.bfloat16).astype(np.float32)
        assert got[path].dtype == np.float32 and np.array_equal(got[path], rounded), path


def test_a_frozen_baseline_reranker_starts_from_the_import(exported, mesh8):
    """The import is a baseline run: `reranker_frozen` warm-starts from its step 0 with every parameter."""
    _, (_, params, _), _, imported = exported
    config = _smoke_config(reranker_frozen)
    config.init.checkpoint, config.init.step = str(imported), 0
    target = TargetConfig.from_json(config.target.arch.to_dict())
    source = draft_state.init_source(config)
    _, fresh, _ = draft_state.init_draft(config, target, mesh8)
    warm = _host(draft_state.warm_start(config, target, mesh8, fresh, source))
    for path, value in _host(params).items():
        assert np.array_equal(warm[path], value), path


# ---- An independent forward over the exported files ---------------------------------------------


def _rms(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rope(x_TxQxD, positions_T, theta):
    d = x_TxQxD.shape[-1]
    angles = positions_T[:, None].astype(np.float64) * theta ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
    x1, x2 = x_TxQxD[..., : d // 2], x_TxQxD[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _deepspec_forward(directory, input_ids_BxT, hidden_BxTxAH, anchors_BxN):
    """Base logits, Markov-corrected logits and confidence logits of DeepSpec's draft, float64, from the
    exported `model.safetensors` and `config.json` alone (teacher-forced predecessors)."""
    w = {k: v.astype(np.float64) for k, v in load_file(directory / "model.safetensors").items()}
    c = json.loads((directory / "config.json").read_text())
    eps, theta, s = c["rms_norm_eps"], c["rope_parameters"]["rope_theta"], c["block_size"]
    q_heads, kv_heads, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    out = {"base": [], "markov": [], "confidence": []}
    for ids, hidden, anchors in zip(input_ids_BxT, hidden_BxTxAH, anchors_BxN):
        t, n = len(ids), len(anchors)
        ctx = _rms(hidden @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
        noise_ids = np.full((n, s), c["mask_token_id"])
        noise_ids[:, 0] = ids[anchors]
        x = w["embed_tokens.weight"][noise_ids.reshape(-1)]
        draft_pos = (anchors[:, None] + np.arange(s)).reshape(-1)
        block = np.repeat(np.arange(n), s)
        visible = np.concatenate(
            [np.arange(t)[None, :] < anchors[block][:, None], block[:, None] == block[None, :]], axis=1
        )
        for layer in range(c["num_hidden_layers"]):
            p = lambda name, layer=layer: w[f"layers.{layer}.{name}.weight"]
            hn = _rms(x, p("input_layernorm"), eps)
            q = _rope(
                _rms((hn @ p("self_attn.q_proj").T).reshape(-1, q_heads, d), p("self_attn.q_norm"), eps),
                draft_pos,
                theta,
            )
            kv_in, kv_pos = np.concatenate([ctx, hn]), np.concatenate([np.arange(t), draft_pos])
            k = _rope(
                _rms((kv_in @ p("self_attn.k_proj").T).reshape(-1, kv_heads, d), p("self_attn.k_norm"), eps),
                kv_pos,
                theta,
            )
            v = (kv_in @ p("self_attn.v_proj").T).reshape(-1, kv_heads, d)
            attn = np.zeros_like(q)
            for head in range(q_heads):
                g = head // (q_heads // kv_heads)
                score = np.where(visible, q[:, head] @ k[:, g].T / np.sqrt(d), -np.inf)
                prob = np.exp(score - score.max(-1, keepdims=True))
                attn[:, head] = prob / prob.sum(-1, keepdims=True) @ v[:, g]
            x = x + attn.reshape(len(x), -1) @ p("self_attn.o_proj").T
            hn = _rms(x, p("post_attention_layernorm"), eps)
            gate = hn @ p("mlp.gate_proj").T
            x = x + (gate / (1 + np.exp(-gate)) * (hn @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T
        h = _rms(x, w["norm.weight"], eps)
        prev_ids = ids[draft_pos]  # the anchor, then the teacher-forced tokens x[a+1..a+6]
        m = w["markov_head.markov_w1.weight"][prev_ids]
        base = h @ w["lm_head.weight"].T
        out["base"].append(base.reshape(n, s, -1))
        out["markov"].append((base + m @ w["markov_head.markov_w2.weight"].T).reshape(n, s, -1))
        confidence = (
            np.concatenate([h, m], -1) @ w["confidence_head.proj.weight"].T + w["confidence_head.proj.bias"]
        )
        out["confidence"].append(confidence.reshape(n, s))
    return {k: np.stack(v) for k, v in out.items()}


def test_exported_files_reproduce_the_drafts_logits(exported, mesh8):
    _, (graphdef, params, rest), directory, _ = exported
    config = _smoke_config()
    model = nnx.merge(graphdef, params, rest)
    side = target_side.side_from_target(
        target_from_config(config.target, seed=config.seed, mesh=mesh8), mesh8
    )
    rng = np.random.default_rng(1)
    b, t, a, h = 2, 40, len(config.data.aux_layer_ids), side.config.hidden_size
    ids_BxT = rng.integers(0, side.config.vocab_size, (b, t)).astype(np.int32)
    aux_BxTxAxH = rng.normal(size=(b, t, a, h)).astype(np.float32)
    anchors_BxN = np.asarray([[0, 9, 21, 32], [4, 5, 17, 30]], np.int32)
    batch = {
        "input_ids": jnp.asarray(ids_BxT),
        "loss_mask": jnp.ones((b, t), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
        "aux_hidden": jnp.asarray(aux_BxTxAxH),
    }
    targets, h_BxNxSxH = block_states(model, side.frozen, batch, jnp.asarray(anchors_BxN), jnp.ones((b, 4)))
    heads = model.heads(side.frozen, h_BxNxSxH, targets.predecessors)
    got = {
        "base": model.base_logits(side.frozen, h_BxNxSxH),
        "markov": heads["logits"],
        "confidence": heads["confidence_logit"],
    }
    # DeepSpec's target_hidden_states: the aux layers concatenated in target_layer_ids order.
    want = _deepspec_forward(
        directory, ids_BxT, aux_BxTxAxH.reshape(b, t, a * h).astype(np.float64), anchors_BxN
    )
    assert np.std(want["confidence"]) > 0.5 and np.std(want["markov"] - want["base"]) > 0.5  # not trivial
    for name, value in want.items():
        scale = np.abs(value).max()
        np.testing.assert_allclose(np.asarray(got[name]), value, rtol=1e-4, atol=1e-4 * scale, err_msg=name)


# ---- Bad input ------------------------------------------------------------------------------------


def test_export_refuses_a_learned_mask_vector(exported, mesh8):
    tmp = exported[0]
    config = _smoke_config(mask_row=-1)
    _save_run(config, tmp / "learned_mask", mesh8, np.random.default_rng(3))
    with pytest.raises(
        ValueError, match=r"draft parameters mask_embedding have no name .*draft\.mask_token_id"
    ):
        export_draft(config, tmp / "learned_mask", tmp / "learned_mask_out")
    assert not (tmp / "learned_mask_out").exists()


def _broken_copy(exported, name, edit_tensors=None, edit_config=None):
    source = exported[2]
    directory = exported[0] / name
    shutil.copytree(source, directory)
    if edit_tensors:
        tensors = edit_tensors(load_file(source / "model.safetensors"))
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    if edit_config:
        config_json = json.loads((source / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps(edit_config(config_json)))
    return directory


def _without(tensors, name):
    return {k: v for k, v in tensors.items() if k != name}


@pytest.mark.parametrize(
    ("case", "edit_tensors", "edit_config", "message"),
    [
        (
            "missing",
            lambda w: _without(w, "layers.1.mlp.up_proj.weight"),
            None,
            r"missing tensor layers\.1\.mlp\.up_proj\.weight \[128, 64\]",
        ),
        (
            "misshaped",
            lambda w: (
                w
                | {"markov_head.markov_w2.weight": np.ascontiguousarray(w["markov_head.markov_w2.weight"].T)}
            ),
            None,
            r"tensor markov_head\.markov_w2\.weight has shape \[32, 49152\], expected \[49152, 32\]",
        ),
        (
            "unknown",
            lambda w: w | {"markov_head.gate_proj.weight": np.zeros((32, 96), np.float32)},
            None,
            r"unexpected tensor markov_head\.gate_proj\.weight \[32, 96\]",
        ),
        (
            "layers",
            None,
            lambda c: c | {"num_hidden_layers": 5, "markov_head_type": "gated"},
            r"num_hidden_layers=5, expected 3 \(draft\.num_layers; pass --config\.draft\.num_layers=5\); "
            r"markov_head_type='gated', expected 'vanilla'",
        ),
        (
            "aux",
            None,
            lambda c: c | {"target_layer_ids": [0, 1, 2]},
            r"target_layer_ids=\[0, 1, 2\], expected \[1, 2, 3\] \(data\.aux_layer_ids; "
            r"pass --config\.data\.aux_layer_ids='\(0, 1, 2\)'\)",
        ),
    ],
)
def test_import_refuses_bad_directories_before_writing(exported, case, edit_tensors, edit_config, message):
    directory = _broken_copy(exported, f"bad_{case}", edit_tensors, edit_config)
    workdir = exported[0] / f"bad_{case}_run"
    with pytest.raises(ValueError, match=message):
        import_draft(_smoke_config(), directory, workdir)
    assert not workdir.exists()


def test_import_cli_refuses_a_mismatched_mask_and_a_used_workdir(exported):
    tmp, _, directory, imported = exported
    smoke = f"--config={ROOT}/configs/baseline.py:smoke"
    proc, errors = _cli(tmp, "import_draft", f"--input={directory}", smoke, f"--workdir={tmp / 'fresh'}")
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
    assert (
        "mask_token_id=3, expected 16 (draft.mask_token_id; pass --config.draft.mask_token_id=3)" in errors[0]
    )
    assert not (tmp / "fresh").exists()
    proc, errors = _cli(tmp, "import_draft", f"--input={directory}", *SMOKE_ARGS, f"--workdir={imported}")
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert "--workdir must be a new work directory" in errors[0]


@pytest.mark.slow
def test_training_continues_from_an_imported_draft(exported, mesh8):
    tmp, (_, params, _), _, imported = exported
    run = tmp / "continued"
    shutil.copytree(imported, run)
    frozen_lr = ["--config.train.peak_lr=1e-30", "--allow_changed=train.peak_lr"]  # moves nothing in float32
    proc, errors = _cli(
        tmp, "train", *SMOKE_ARGS, f"--workdir={run}", "--config.train.stop_step=1", *frozen_lr
    )
    assert proc.returncode == 0 and not errors, proc.stderr[-3000:]
    assert "resumed from step 0" in (run / "train.log").read_text()
    config = checkpoints.run_config(run)
    target = TargetConfig.from_json(config.target.arch.to_dict())
    _, trained, _, step = draft_state.restore_draft(config, target, mesh8, run)
    # At a learning rate of 1e-30 the imported parameters come out unchanged: they are where training started.
    assert step == 1
    want, got = _host(params), _host(trained)
    assert all(np.array_equal(got[path], value) for path, value in want.items())
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and np.isfinite(first["train/loss"])


def test_the_serving_checker_reads_deepspecs_layout(exported):
    """The export (DeepSpec's layout and the trainers' own directories, no side files) loads in every
    consumer; DeepSpec's own bf16 save, sharded behind an index, differs for the engines reading DeepSpec's
    layout only in its confidence head, which vLLM, SGLang and TensorRT-LLM build in float32."""
    tmp, _, directory, _ = exported
    assert consumers.check_directory(directory) == []
    config_json = json.loads((directory / "config.json").read_text())
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in load_file(directory / "model.safetensors").items()}
    save_hf_checkpoint(tmp / "bf16_served", config_json, tensors, shard_size_bytes=4 << 20)
    main = [name for name, consumer in consumers.CONSUMERS.items() if not consumer.subdir]
    problems = consumers.check_directory(tmp / "bf16_served", main)
    assert sorted({line.split(":")[0] for line in problems}) == ["sglang", "trtllm", "vllm"], problems
    assert len(problems) == 2 * 3, problems
    assert all("confidence_head.proj." in line and "is BF16" in line for line in problems)
