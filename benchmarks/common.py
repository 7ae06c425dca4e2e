"""What the benchmark scripts share: experiment configs by file (scripts put the repository on `sys.path`),
and the ablations' validation runs of one checkpoint under two variants."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def load_config_module(path: str) -> ModuleType:
    """An experiment config file (`configs/<name>.py`, relative to the repository or absolute) as a module
    with `get_config(preset)`."""
    file = Path(path) if Path(path).is_absolute() else ROOT / path
    if not file.is_file():
        raise FileNotFoundError(f"config file {path} not found")
    spec = importlib.util.spec_from_file_location(f"configs.{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ablation(checkpoint: str, variants, names: tuple[str, ...], batches: int = 0) -> None:
    """Evaluates `checkpoint` on its validation cache once per variant and prints the metrics `names` per
    variant and the first minus the second. `variants(config, side, graphdef)` returns `{label:
    (graphdef, frozen)}` (two entries): the model and frozen inputs each evaluation runs with."""
    from dspark_jax import groups, sharding
    from dspark_jax.data.pipeline import make_iterator
    from dspark_jax.run import checkpoints, draft_state, sources, target_side
    from dspark_jax.training import evaluation

    config = checkpoints.run_config(checkpoint)
    mesh = sharding.make_mesh(config.mesh.to_dict())
    experiment = groups.get(config.experiment)
    side, paths = target_side.prepare_target_side(config, mesh)
    source = sources.open_source(paths["val"], config, side)
    graphdef, params, rest, step = draft_state.restore_draft(config, side.config, mesh, checkpoint)
    micro_rows = config.train.global_batch // config.train.grad_accum
    pipeline = sources.pipeline_config(config, side, batch_size=micro_rows, seed=config.seed, num_epochs=1)
    rows = {
        label: evaluation.evaluate(
            evaluation.make_eval_sums(model, experiment, ablate=False),  # the two variants are the ablation
            experiment,
            params,
            rest,
            frozen,
            make_iterator(source, pipeline),
            mesh,
            batches,
        )
        for label, (model, frozen) in variants(config, side, graphdef).items()
    }
    first, second = rows.values()
    width = max(16, *(len(n) + 2 for n in names))
    print(f"{config.experiment} step {step}, {len(source)} validation samples")
    print(f"{'':14s}" + "".join(f"{n:>{width}s}" for n in names))
    for label, values in rows.items():
        print(f"{label:14s}" + "".join(f"{values[n]:{width}.4f}" for n in names))
    print(f"{'difference':14s}" + "".join(f"{first[n] - second[n]:{width}.4f}" for n in names))
