"""The speculative decoder of a run: a loaded target, a restored draft and the group's proposer and side
inputs, from the run's config."""

from __future__ import annotations

import logging

from jax.sharding import Mesh

from dspark_jax import groups
from dspark_jax.inference.decoder import SpeculativeDecoder
from dspark_jax.run import target_side
from dspark_jax.target import Target

log = logging.getLogger(__name__)


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
) -> SpeculativeDecoder:
    """The experiment's speculative decoder for a loaded target and a draft `(graphdef, params, rest)`;
    `select_top_k` and `draft_len` default to the config's `generate` section; `schedule` and
    `temperatures` as in `SpeculativeDecoder`."""
    if select_top_k is None:  # `get`: absent from configs stored before it
        select_top_k = config.generate.get("select_top_k", 0)
    if draft_len is None:
        draft_len = config.generate.get("draft_len", 0)
    side = target_side.side_from_target(target, mesh)
    side = target_side.with_side_inputs(config, side)
    return SpeculativeDecoder(
        target.model,
        *draft,
        side.frozen,
        proposer=groups.get(config.experiment).proposer,
        aux_layer_ids=config.data.aux_layer_ids,
        eos_ids=target.eos_ids,
        pad_id=target.tokenizer.pad_id,
        batch_size=batch_size,
        mesh=mesh,
        select_top_k=select_top_k,
        schedule=schedule,
        temperatures=temperatures,
        draft_len=draft_len,
    )
