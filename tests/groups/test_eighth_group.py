"""An eighth group, added by this file alone: a draft that reads one extra side input and logs one extra
metric trains, evaluates and decodes losslessly through the registry. Nothing outside this file names it:
the target side, the training step, the evaluation, the AOT check and the decoder get its side input
through `Experiment.run.side_inputs` and its metric through `Experiment.model.metrics`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import baseline
from dspark_jax import groups, sharding
from dspark_jax.data.conversations import GSM8K_VAL256, read_turns_jsonl
from dspark_jax.draft import objective
from dspark_jax.draft.model import DSparkDraft
from dspark_jax.groups.baseline import draft_sums
from dspark_jax.suite import measure
from dspark_jax.target import target_from_config
from dspark_jax.training import aot
from dspark_jax.training.evaluation import evaluate_checkpoint
from dspark_jax.training.loop import train

pytestmark = pytest.mark.slow  # trains, evaluates and decodes end to end

PRIOR = "toy_prior"  # the side input: one frozen number per vocabulary id
MADE = []  # the targets the side input was made for (fingerprint, vocabulary)


def prior_of(vocab_size: int) -> jax.Array:
    return 0.5 * jnp.sin(jnp.arange(vocab_size, dtype=jnp.float32))


def side_inputs(config, *, fingerprint, tokenizer_fingerprint, vocab_size, load_target):
    MADE.append((fingerprint, vocab_size))
    return {PRIOR: prior_of(vocab_size)}


def synthetic_side_inputs(config, vocab_size):
    return {PRIOR: jnp.zeros((vocab_size,), jnp.float32)}


class PriorDraft(DSparkDraft):
    """The baseline draft whose anchor input gains the side input's value of the anchor token."""

    def block_inputs(self, frozen, anchor_tokens_BxN):
        x_BxNxSxH = super().block_inputs(frozen, anchor_tokens_BxN)
        prior_BxN = jnp.take(frozen.side_inputs[PRIOR], anchor_tokens_BxN)
        return x_BxNxSxH.at[:, :, 0].add(prior_BxN[..., None].astype(x_BxNxSxH.dtype))


def prior_sums(model, frozen, batch):
    """The baseline's sums plus the side input summed over the kept blocks' anchor tokens."""
    anchors_BxN = jnp.take_along_axis(batch["input_ids"], batch["anchors"], axis=1)
    keep_BxN = batch["block_keep"].astype(jnp.float32)
    at_anchors = jnp.sum(jnp.take(frozen.side_inputs[PRIOR], anchors_BxN) * keep_BxN)
    return draft_sums(model, frozen, batch) | {"prior_sum": at_anchors, "prior_blocks": jnp.sum(keep_BxN)}


def prior_metrics(sums):
    return objective.metrics_from_sums(sums) | {"anchor_prior": sums["prior_sum"] / sums["prior_blocks"]}


EIGHTH = groups.register(
    groups.Experiment(
        name="toy_prior",
        model=groups.Model(build_draft=PriorDraft, train_sums=prior_sums, metrics=prior_metrics),
        run=groups.Run(side_inputs=side_inputs, synthetic_side_inputs=synthetic_side_inputs),
    )
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("eighth")
    config = baseline.get_config("smoke")
    config.experiment = EIGHTH.name
    config.data.cache_dir = str(work / "caches")
    config.mesh.fsdp = 1
    config.train.stop_step = config.train.total_steps = 2
    return config, work / "run", train(config, work / "run")


def test_it_trains_and_evaluates_with_its_side_input_and_metric(run):
    config, workdir, last = run
    vocab = config.target.arch.vocab_size
    assert MADE and all(v == vocab for _, v in MADE)  # made for the run's own target
    assert np.isfinite(last["train/loss"]) and abs(last["eval/anchor_prior"]) > 0
    offline = evaluate_checkpoint(config, workdir)
    assert offline["step"] == 2
    assert offline["anchor_prior"] == pytest.approx(last["eval/anchor_prior"], rel=1e-6)
    assert offline["tau_prob"] == pytest.approx(last["eval/tau_prob"], rel=1e-6)
    report = aot.step_memory(config, micro_batch=1)  # the AOT check places the abstract side input
    arch, itemsize = config.target.arch, jnp.dtype(config.target.param_dtype).itemsize
    matrices = 2 * arch.vocab_size * arch.hidden_size * itemsize  # the embedding and the LM head
    assert report["per_device_bytes"]["frozen_target"] == matrices + 4 * arch.vocab_size


def test_it_decodes_losslessly_with_its_side_input(run):
    config, workdir, _ = run
    mesh = sharding.make_mesh(config.mesh.to_dict())
    target = target_from_config(config.target, seed=config.seed, mesh=mesh)
    settings = measure.DecodeSettings(max_new_tokens=12, concurrency=2)
    decoder, step = measure.speculative_decoder(config, workdir, target, mesh, settings)
    np.testing.assert_array_equal(decoder.frozen.side_inputs[PRIOR], prior_of(config.target.arch.vocab_size))
    conversations = read_turns_jsonl(GSM8K_VAL256)[:4]
    result = measure.speculate(
        decoder, step, config, target, conversations, settings, input_name="gsm8k", time_phases=False
    )
    assert result["identical_to_target_greedy"] == "4/4"
    assert result["speculative"]["cycles"] > 0
