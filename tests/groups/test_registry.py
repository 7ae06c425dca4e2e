"""The experiment seam: a throwaway group, registered here alone, trains through the `train` entry point."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from configs import baseline
from dspark_jax import groups
from dspark_jax.draft import objective
from dspark_jax.draft.model import DSparkDraft
from dspark_jax.groups.baseline import draft_sums
from dspark_jax.training.loop import train


class BiasedDraft(DSparkDraft):
    """The baseline draft plus a learned vocabulary bias on the corrected logits."""

    def __init__(self, cfg, *, rngs, **kw):
        super().__init__(cfg, rngs=rngs, **kw)
        self.vocab_bias = nnx.Param(jnp.zeros((cfg.vocab_size,)), axes=("vocab",))

    def corrected(self, base_logits_xV, h_xH, predecessors_x, *args, **kwargs):
        out = super().corrected(base_logits_xV, h_xH, predecessors_x, *args, **kwargs)
        return out | {"logits": out["logits"] + self.vocab_bias.get_value()}


CALLS = {"sums": 0}


def biased_sums(model, frozen, batch):
    CALLS["sums"] += 1  # counts traces: the step and the evaluation both come here
    return draft_sums(model, frozen, batch) | {"bias_sq": jnp.sum(model.vocab_bias.get_value() ** 2)}


TOY = groups.register(
    groups.Experiment(
        name="toy_biased",
        model=groups.Model(
            build_draft=BiasedDraft,
            train_sums=biased_sums,
            metrics=lambda sums: objective.metrics_from_sums(sums) | {"bias_sq": sums["bias_sq"]},
        ),
    )
)


def test_unknown_group_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"config.experiment='nope' is not a registered group.*baseline"):
        groups.get("nope")
    with pytest.raises(ValueError, match="already registered"):
        groups.register(TOY)


@pytest.mark.slow
def test_throwaway_group_trains_two_steps(tmp_path):
    config = baseline.get_config("smoke")
    config.experiment = "toy_biased"
    config.data.cache_dir = str(tmp_path / "caches")
    config.mesh.fsdp = 1
    config.train.stop_step = config.train.total_steps = 2
    config.train.warmup_fraction = 0.0
    last = train(config, tmp_path / "work")
    assert CALLS["sums"] >= 2
    assert np.isfinite(last["train/loss"]) and "eval/bias_sq" in last and last["train/bias_sq"] > 0
    state = ocp.StandardCheckpointer().restore(tmp_path / "work" / "checkpoints" / "2" / "state")
    bias = np.asarray(jax.tree.leaves(state["params"]["vocab_bias"])[0])
    assert bias.shape == (config.target.arch.vocab_size,) and np.abs(bias).max() > 0  # gradients reached it
