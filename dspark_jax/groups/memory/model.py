"""Draft Memory's model pieces and index math (the seed's "Draft Memory"; docs/design.md section 1).

A block at anchor `a` gives final states `h[0..S-1]` (the seed's 1-based `h_1..h_S`, `h[i]` predicting
`x[a+1+i]`). Its greedy proposals are `argmax(l0_i + Markov(t_i))`; `m` counts the leading ones that
equal the recorded tokens. The next block is anchored at `a' = a + m + 1` (the first mismatching
position's recorded token, or the bonus position `a + S + 1` when all `S` match) and reads the old
block's states that predicted positions past `a'` as memory:

  memory slot `j = 0..S-2` holds `h[j+1]` (the seed's `h_{j+2}`) at RoPE position `a + j + 2`, the
  position it predicted; the slots `j >= m` are kept (the seed's `k in {m+2..S}`), so the first kept
  one sits at `a' + 1`, and `m = S` keeps none.

Every memory state passes the adapter `M = RMSNorm_gamma(P stop_gradient(h))` once; each draft layer
projects `M` with its own K/V weights (`DraftLayer`), one softmax over `[context; memory; block]`.
Training (`experiments.memory`) simulates the rejection from the recorded sequence; inference
(`experiments.memory.MEMORY_PROPOSER`) takes `m` from real target verification.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.draft import blocks, objective
from dspark_jax.draft.model import DraftConfig, DraftMemory, DSparkDraft, FrozenTarget, vocab_columns
from dspark_jax.nn import Dtype, Linear, RMSNorm

MEMORY_SOURCES = ("with_memory", "no_memory", "disabled")
MEMORY_STATES = ("draft", "target")


@dataclasses.dataclass(frozen=True)
class MemoryDraftConfig(DraftConfig):
    """`DraftConfig` plus where inference takes the next round's memory from.

    Attributes:
      memory_source: 'with_memory' = the states of the round's own (memory-conditioned) draft pass, as
        inference naturally runs; 'no_memory' = one extra memory-free draft pass per round, the source
        training uses (its stage 1); 'disabled' = no memory at all (an ablation: the same weights drafting
        like the baseline). Inference only: no parameter depends on it.
      memory_states: what training and teacher-forced evaluation fill the memory with: 'draft' = stage 1's
        final states (the seed's Draft Memory) or 'target' = the target's own final states at the same
        slots (a perfect stage 1: slot `j` holds `S[a+j+1]`, the teacher of the prediction it sits after;
        the positive control of the memory path, and the upper bound of what a memory can add).
        Decoding always reads the draft's own states.
    """

    memory_source: str = "with_memory"
    memory_states: str = "draft"

    def __post_init__(self):
        super().__post_init__()
        if self.memory_source not in MEMORY_SOURCES:
            raise ValueError(f"draft memory_source={self.memory_source!r}; choose one of {MEMORY_SOURCES}")
        if self.memory_states not in MEMORY_STATES:
            raise ValueError(f"draft memory_states={self.memory_states!r}; choose one of {MEMORY_STATES}")


class MemoryAdapter(nnx.Module):
    """`M = RMSNorm_gamma(P h)`: `P` an `H x H` projection without bias, `gamma` the trainable norm scale."""

    def __init__(self, hidden: int, eps: float, *, rngs: nnx.Rngs, param_dtype: Dtype, dtype: Dtype):
        kw = dict(rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        self.proj = Linear((hidden,), (hidden,), ("embed", "mlp"), **kw)
        self.norm = RMSNorm(hidden, eps, param_dtype=param_dtype)

    def __call__(self, h_xH: jax.Array) -> jax.Array:
        return self.norm(self.proj(h_xH))


class MemoryDraft(DSparkDraft):
    """The DSpark draft plus the memory adapter (+H^2 + H parameters: 6,556,160 at paper shapes)."""

    def __init__(self, cfg: DraftConfig, *, rngs: nnx.Rngs, param_dtype: Dtype | None = None, dtype=None):
        super().__init__(cfg, rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        self.memory_adapter = MemoryAdapter(
            cfg.hidden_size,
            cfg.rms_norm_eps,
            rngs=rngs,
            param_dtype=jnp.dtype(param_dtype or cfg.param_dtype),
            dtype=self.dtype,
        )

    def memory(self, old_h_xNxSxH, old_anchors_xN, matches_xN, keep_xN) -> DraftMemory:
        """The memory of the blocks that follow blocks anchored at `old_anchors` with final states
        `old_h` and `matches` leading matches (`keep` False = no memory at all)."""
        positions_xNxM, valid_xNxM = memory_slots(old_anchors_xN, matches_xN, keep_xN, self.cfg.block_size)
        sources_xNxMxH = jax.lax.stop_gradient(old_h_xNxSxH[..., 1:, :]).astype(self.dtype)
        states_xNxMxH = self.memory_adapter(sources_xNxMxH)
        return DraftMemory(states_xNxMxH, positions_xNxM, valid_xNxM)


def memory_slots(old_anchors_xN, matches_xN, keep_xN, block_size: int) -> tuple[jax.Array, jax.Array]:
    """RoPE positions `a + j + 2` (int32[..., N, S-1]) and validity `j >= m and keep` of memory slots `j`."""
    j_M = jnp.arange(block_size - 1, dtype=jnp.int32)
    positions_xNxM = old_anchors_xN.astype(jnp.int32)[..., None] + 2 + j_M
    valid_xNxM = (j_M >= matches_xN[..., None]) & (keep_xN[..., None] != 0)
    return positions_xNxM, valid_xNxM


def leading_matches(
    draft: DSparkDraft, frozen: FrozenTarget, h_BxNxSxH: jax.Array, targets: blocks.BlockTargets
) -> jax.Array:
    """`m` int32[B, N]: leading predictions whose greedy choice `argmax(l0_i + Markov(x[a+i]))` equals the
    recorded valid label `x[a+1+i]`.

    With the recorded predecessors the choices up to the first mismatch are exactly those of token-by-token
    greedy drafting (each predecessor so far was a match), so this is greedy's first error, found in
    parallel. The vocabulary-sized argmax runs `anchor_chunk` blocks at a time.
    """

    ids_K = vocab_columns(frozen)

    def choices(chunk):
        logits = draft.heads(frozen, chunk["h"], chunk["predecessors"])["logits"]
        choice = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return choice if ids_K is None else ids_K[choice]

    inputs = {"h": h_BxNxSxH, "predecessors": targets.predecessors}
    stacked = objective.scan_anchor_chunks(choices, inputs, draft.cfg.anchor_chunk)
    choices_BxNxS = objective.from_anchor_chunks(stacked, h_BxNxSxH.shape[1])
    matches_BxNxS = (choices_BxNxS == targets.labels) & (targets.eval_mask != 0)
    return jnp.sum(jnp.cumprod(matches_BxNxS.astype(jnp.int32), axis=-1), axis=-1)


class Transition(NamedTuple):
    """Stage 2's blocks: anchors `a' = a + m + 1` and which transitions are kept, each `[B, N]`."""

    anchors_BxN: jax.Array
    keep_BxN: jax.Array


def transition(anchors_BxN, matches_BxN, block_keep_BxN, loss_mask_BxT, positions_BxT) -> Transition:
    """The blocks that follow the blocks at `anchors_BxN` after `matches_BxN` leading matches.

    A transition is kept when its old block was kept and the new anchor `a'` is a response token of the
    same sample (it did not leave the response, the sequence or the packed sample). Dropped ones keep
    their old anchor (any in-range value does: they carry no weight). Whether `a'` has a supervised next
    token is the stage-2 block's own `eval_mask[0]` (`blocks.block_targets`).
    """
    anchors_BxN = anchors_BxN.astype(jnp.int32)
    new_BxN = anchors_BxN + matches_BxN + 1
    in_response_BxN, in_range_BxN = blocks.gather_blocks(loss_mask_BxT.astype(jnp.int32), new_BxN[..., None])
    old_pos_BxN, _ = blocks.gather_blocks(positions_BxT.astype(jnp.int32), anchors_BxN[..., None])
    new_pos_BxN, _ = blocks.gather_blocks(positions_BxT.astype(jnp.int32), new_BxN[..., None])
    same_sample_BxN = new_pos_BxN == old_pos_BxN + matches_BxN[..., None] + 1
    keep_BxN = (block_keep_BxN != 0) & in_range_BxN[..., 0] & (in_response_BxN[..., 0] != 0)
    keep_BxN &= same_sample_BxN[..., 0]
    return Transition(jnp.where(keep_BxN, new_BxN, anchors_BxN), keep_BxN.astype(jnp.uint8))
