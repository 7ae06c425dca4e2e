"""The learning-rate schedule and the AdamW optimizer (optax).

Paper preset (docs/design.md section 3): AdamW with weight decay 0, betas (0.9, 0.999), eps 1e-8
(the torch/SpecForge defaults), global-norm clip 1.0, peak LR 3e-4, linear warmup over
4% of a 26,040-step schedule, cosine to 0. A one-epoch run stops at step 2,604 while the
schedule keeps its full length: the stop step belongs to the training loop, never to the
schedule.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from dspark_jax import groups

_TRAIN, _FROZEN = "train", "frozen"

# A pytree of bools shaped like the parameters (True = trained), or a function building
# one from the parameters.
TrainableMask = Any | Callable[[Any], Any]


def make_schedule(peak_lr: float, total_steps: int, warmup_fraction: float = 0.04) -> optax.Schedule:
    """Linear warmup from 0 to `peak_lr`, then cosine decay to 0 at `total_steps`.

    The warmup lasts `round(warmup_fraction * total_steps)` steps and reaches `peak_lr`
    exactly at its last step; the value is 0 from `total_steps` on. `schedule(count)` is
    the learning rate of the update that optax applies when its step count is `count`.
    """
    if total_steps <= 0:
        raise ValueError(f"{total_steps=} must be positive")
    if not 0.0 <= warmup_fraction < 1.0:
        raise ValueError(f"{warmup_fraction=} must be in [0, 1)")
    if peak_lr <= 0.0:
        raise ValueError(f"{peak_lr=} must be positive")
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak_lr,
        warmup_steps=round(warmup_fraction * total_steps),
        decay_steps=total_steps,
        end_value=0.0,
    )


def make_optimizer(
    schedule: optax.ScalarOrSchedule,
    *,
    weight_decay: float = 0.0,
    clip_norm: float | None = 1.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    trainable_mask: TrainableMask | None = None,
    scaled_mask: TrainableMask | None = None,
    lr_scale: float = 1.0,
) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW, optionally only on the parameters marked trainable.

    The first moment is kept in float32 (`mu_dtype`); the second follows the parameters,
    which are float32 master weights. With `trainable_mask`, frozen leaves get zero
    updates, hold no optimizer state (optax `MaskedNode` in their place) and do not count
    in the clipping norm. `clip_norm=None` disables clipping. With `scaled_mask` (same form), the
    updates of the leaves it marks are scaled by `lr_scale`: their learning rate (and decay) is
    `lr_scale` x the schedule's, the rest's is the schedule's.
    """
    adamw = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mu_dtype=jnp.float32)
    if scaled_mask is not None and lr_scale != 1.0:
        adamw = optax.chain(adamw, optax.masked(optax.scale(lr_scale), _on_values(scaled_mask)))
    tx = adamw if clip_norm is None else optax.chain(optax.clip_by_global_norm(clip_norm), adamw)
    if trainable_mask is None:
        return tx

    def labels(params: Any) -> Any:
        mask = trainable_mask(params) if callable(trainable_mask) else trainable_mask
        return jax.tree.map(lambda trained: _TRAIN if trained else _FROZEN, mask)

    return optax.multi_transform({_TRAIN: tx, _FROZEN: optax.set_to_zero()}, labels)


def _on_values(mask: TrainableMask) -> Callable[[Any], Any]:
    """`mask` as a function of the parameters optax passes it, which under `multi_transform` hold
    `MaskedNode`s in place of another branch's leaves: those are not marked."""

    def marked(params: Any) -> Any:
        full = mask(params) if callable(mask) else mask
        return jax.tree.map(
            lambda p, m: False if isinstance(p, optax.MaskedNode) else m,
            params,
            full,
            is_leaf=lambda x: isinstance(x, optax.MaskedNode),
        )

    return marked


log = logging.getLogger(__name__)


def make_training_optimizer(
    config, params=None, copied: TrainableMask | None = None
) -> tuple[optax.Schedule, optax.GradientTransformation]:
    """The schedule and AdamW of `config.train`; the experiment's frozen parameters (if any) of
    `params` get no update; the parameters `copied` marks (those that start from the target's,
    `draft_state.copied_mask`) learn at `train.copied_lr_scale` x the schedule's rate."""
    t = config.train
    trainable = groups.get(config.experiment).model.trainable
    schedule = make_schedule(t.peak_lr, t.total_steps, t.warmup_fraction)
    return schedule, make_optimizer(
        schedule,
        weight_decay=t.weight_decay,
        clip_norm=t.clip_norm,
        b1=t.b1,
        b2=t.b2,
        eps=t.eps,
        trainable_mask=None if trainable is None or params is None else trainable(params),
        scaled_mask=copied,
        lr_scale=t.get("copied_lr_scale", 1.0),  # absent from configs stored before it
    )


def optimizer_state_shardings(optimizer: optax.GradientTransformation, params, mesh: Mesh):
    """Shardings of `optimizer.init(params)` laid out for FSDP: a leaf shaped like a parameter whose key
    path ends with that parameter's (the Adam moments) takes the parameter's sharding; the rest (step
    counts) is replicated. `params` carry their shardings (arrays or `ShapeDtypeStruct`s)."""
    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
    by_path = {jax.tree_util.keystr(path): p for path, p in jax.tree_util.tree_leaves_with_path(params)}

    def one(path, x):
        name = jax.tree_util.keystr(path)
        matches = [k for k, p in by_path.items() if name.endswith(k) and p.shape == x.shape]
        return by_path[max(matches, key=len)].sharding if matches else replicated

    return jax.tree_util.tree_map_with_path(one, jax.eval_shape(optimizer.init, params))


def init_optimizer_state(optimizer: optax.GradientTransformation, params, mesh: Mesh):
    """`optimizer.init(params)` placed by `optimizer_state_shardings` (moments sharded like their
    parameters, not whole on one device)."""
    shardings = optimizer_state_shardings(optimizer, params, mesh)
    return jax.jit(optimizer.init, out_shardings=shardings)(params)
