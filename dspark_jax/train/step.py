"""The DSpark update step as pure functions over NNX state, split for gradient accumulation.

One optimizer step over a global batch of `M` micro-batches:

  global_weight = sum of position weights over the whole global batch (host, param-free)
  for each micro-batch:  grads, sums += micro_step(params, ..., micro_batch, global_weight)
  params, opt_state = apply_step(...)

Because the loss denominators do not depend on the parameters, each micro-batch's gradient
of `numerator / global_weight` adds up to the gradient of the globally normalised loss
(DESIGN.md section 2), whatever the number of devices or micro-batches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dspark_jax.draft import objective
from dspark_jax.draft.model import DSparkDraft, FrozenTarget

Batch = Mapping[str, jax.Array]

# The pipeline fields a step reads on device (the rest stay on the host).
DEVICE_FIELDS = ("input_ids", "aux_hidden", "last_hidden", "anchors", "labels", "predecessors", "eval_mask")


def teacher_hidden(last_hidden_BxTxH: jax.Array, anchors_BxN: jax.Array, block_size: int) -> jax.Array:
    """`S[a+i]` for every block and prediction, `[B, N, K, H]` (positions past T clamp; they are masked)."""
    t = last_hidden_BxTxH.shape[1]
    positions_BxNK = jnp.minimum(anchors_BxN[:, :, None] + jnp.arange(block_size), t - 1)
    b, n, k = positions_BxNK.shape
    gathered = jnp.take_along_axis(last_hidden_BxTxH, positions_BxNK.reshape(b, n * k, 1), axis=1)
    return gathered.reshape(b, n, k, -1)


def draft_sums(model: DSparkDraft, frozen: FrozenTarget, batch: Batch) -> dict[str, jax.Array]:
    """Objective and metric sums of the baseline draft on one (micro-)batch."""
    cfg = model.cfg
    anchors_BxN = batch["anchors"]
    anchor_tokens_BxN = jnp.take_along_axis(batch["input_ids"], anchors_BxN, axis=1)
    ctx_BxTxH = model.context(batch["aux_hidden"].astype(model.dtype))
    h_BxNxKxH = model.backbone(
        model.block_inputs(frozen, anchor_tokens_BxN), model.context_kv(ctx_BxTxH), anchors_BxN
    )
    return objective.block_objective_sums(
        lambda chunk: model.heads(frozen, chunk["h"], chunk["predecessors"]),
        {"h": h_BxNxKxH, "predecessors": batch["predecessors"]},
        teacher_hidden(batch["last_hidden"], anchors_BxN, cfg.block_size),
        frozen.lm_head_HxV,
        batch["labels"],
        batch["eval_mask"],
        anchor_chunk=cfg.anchor_chunk,
    )


def global_weight(eval_masks_BxNxK: list[np.ndarray]) -> np.float32:
    """Loss denominator of a global batch (all its micro-batches), computed on the host."""
    decay_K = np.exp(-np.arange(eval_masks_BxNxK[0].shape[-1]) / objective.POSITION_DECAY)
    return np.float32(sum(float((m.astype(np.float64) * decay_K).sum()) for m in eval_masks_BxNxK))


def micro_step(
    params: nnx.State,
    rest: nnx.State,
    frozen: FrozenTarget,
    batch: Batch,
    weight: jax.Array,
    *,
    graphdef: nnx.GraphDef,
) -> tuple[nnx.State, dict[str, jax.Array]]:
    """Gradient of this micro-batch's share of the global loss, and its metric sums."""

    def loss_fn(p):
        sums = draft_sums(nnx.merge(graphdef, p, rest), frozen, batch)
        return objective.weighted_loss(sums, weight), sums

    grads, sums = jax.grad(loss_fn, has_aux=True)(params)
    return grads, sums


def accumulate(total: Any, new: Any) -> Any:
    """Elementwise sum of two pytrees (gradients or sums)."""
    return jax.tree.map(jnp.add, total, new)


def apply_step(
    params: nnx.State, opt_state: optax.OptState, grads: nnx.State, *, optimizer: optax.GradientTransformation
) -> tuple[nnx.State, optax.OptState, jax.Array]:
    """One optimizer update; returns the new params, optimizer state and the pre-clip gradient norm."""
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, optax.global_norm(grads)
