"""The main job's exported draft in vLLM's and speculators' own code, against the JAX draft, on real text.

  python results/demo-serve-2026-12-07/check_consumers.py WORKDIR EXPORT OUT_DIR

WORKDIR is the run (`workdirs/memory-demo`), EXPORT what `python -m dspark_jax.export --checkpoint=WORKDIR
--output=EXPORT --baseline_part` wrote. The first GSM8K prompts (two rows of 64 tokens) go through the run's
target (its states as transformers lists them: the embedding output, then each layer's); each consumer's
script of `tests/interop/` loads its directory strictly with the consumer's own loader and runs its forward on
blocks of those prompts; the JAX draft's baseline part (stage 1 of Draft Memory: the memory model without
memory, the draft that was exported) runs on the same blocks. Prints and writes `OUT_DIR/consumers.json`.
"""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dspark_jax import sharding  # noqa: E402
from dspark_jax.data.conversations import GSM8K_VAL256, read_turns_jsonl  # noqa: E402
from dspark_jax.interop import consumers  # noqa: E402
from dspark_jax.run import checkpoints, draft_state, target_side  # noqa: E402
from dspark_jax.run.deepspec_checkpoint import draft_vocabulary  # noqa: E402
from tests.interop import exports  # noqa: E402


def main(workdir: Path, export: Path, out: Path) -> None:
    config = checkpoints.run_config(workdir)
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1})
    target = target_side.load_run_target(config, mesh)
    side = target_side.side_from_target(target, mesh)
    ids_K = draft_vocabulary(config, mesh)
    if ids_K is not None:
        side = target_side.with_draft_vocab(side, ids_K, mesh)
    graphdef, params, rest, step = draft_state.restore_draft(config, target.config, mesh, workdir)
    model = nnx.merge(graphdef, params, rest)

    t = 64
    text = "\n".join(turns[0] for turns in read_turns_jsonl(GSM8K_VAL256)[:8])
    ids = np.asarray(target.tokenizer.encode(text)[: 2 * t], np.int64).reshape(2, t)
    layers = tuple(range(-1, target.config.num_layers))
    output = jax.jit(lambda x: target.model(x, aux_layer_ids=layers))(jnp.asarray(ids, jnp.int32))
    raw = np.asarray(output.aux_BxTxAxH)  # [B, T, L + 1, H]: the embedding output, then each layer's
    hidden = np.moveaxis(raw, 2, 1).astype(np.float32)
    hidden[:, -1] = np.asarray(output.hidden_BxTxH)  # transformers' last entry: the final norm's output
    inputs = {"input_ids": ids, "hidden": hidden, "anchors": np.asarray([[3, 17, 30, 44], [0, 12, 25, 50]])}
    want = exports.reference(model, side, config, inputs, mesh)
    report = {
        "workdir": str(workdir),
        "step": step,
        "export": str(export),
        "draft_vocab": None if ids_K is None else len(ids_K),
    }
    for name in ("vllm", "speculators"):
        directory = consumers.directory_of(export, name)
        got = exports.run_consumer(name, directory, inputs, out / name)
        report[name] = {"directory": str(directory), **exports.differences(got, want)}
        report[name]["greedy_agreement"] = float(
            np.mean(got["markov"].argmax(-1) == want["markov"].argmax(-1))
        )
        print(name, report[name])
    report["problems"] = consumers.check_directory(export, ("vllm", "speculators"))
    (out / "consumers.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main(*(Path(a) for a in sys.argv[1:4]))
