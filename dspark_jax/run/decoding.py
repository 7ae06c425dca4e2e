"""The speculative decoder of a run: a loaded target, a restored draft and the group's proposer and side
inputs, from the run's config."""

from __future__ import annotations

from jax.sharding import Mesh

from dspark_jax import groups
from dspark_jax.inference.decoder import SpeculativeDecoder
from dspark_jax.run import target_side
from dspark_jax.target import Target


def speculative_decoder(
    config,
    target: Target,
    draft,
    *,
    batch_size: int,
    mesh: Mesh,
    select_top_k: int | None = None,
    schedule: str = "fixed",
    temperatures: dict[str, tuple[float, ...]] | None = None,
    draft_len: int | None = None,
    draft_vocab: int | None = None,
) -> SpeculativeDecoder:
    """The experiment's speculative decoder for a loaded target and a draft `(graphdef, params, rest)`;
    `select_top_k`, `draft_len` and `draft_vocab` default to the config's `generate` section (`draft_vocab`
    then to the vocabulary the draft trained on, `train.draft_vocab`); `schedule` and `temperatures` as in
    `SpeculativeDecoder`. `draft_vocab = N` restricts the proposals to the `N` tokens the run's training
    text uses most (`target_side.training_vocabulary`; 0 = the whole vocabulary)."""
    if select_top_k is None:  # `get`: absent from configs stored before it
        select_top_k = config.generate.get("select_top_k", 0)
    if draft_len is None:
        draft_len = config.generate.get("draft_len", 0)
    if draft_vocab is None:
        draft_vocab = config.generate.get("draft_vocab", 0) or config.train.get("draft_vocab", 0)
    side = target_side.side_from_target(target, mesh)
    ids = None
    if draft_vocab:
        ids = target_side.training_vocabulary(config, side, draft_vocab)
    side = target_side.with_side_inputs(config, side)
    return SpeculativeDecoder(
        target.model,
        *draft,
        side.frozen,
        proposer=groups.get(config.experiment).model.proposer,
        aux_layer_ids=config.data.aux_layer_ids,
        eos_ids=target.eos_ids,
        pad_id=target.tokenizer.pad_id,
        batch_size=batch_size,
        mesh=mesh,
        select_top_k=select_top_k,
        schedule=schedule,
        temperatures=temperatures,
        draft_len=draft_len,
        draft_vocab=ids,
    )
