"""Online training (`data.features = "online"`): the frozen target runs inside the training step.

The pipeline then reads token rows only (a token cache: `dspark_jax.cache` with `states=False`). Before
the group's objective, each micro-step and each evaluation step runs the frozen target over the batch's
rows with the cache builder's forward (`cache.features.target_states`): an unpacked row right-padded
after its real tokens, a packed row with each sample's own `positions` (a token sees only its sample).
The states it returns, `aux_hidden` and `last_hidden`, join the batch rounded to `data.online_dtype`:
bfloat16 by default, the numbers an offline run reads from its cache. The objective is unchanged.

The target's parameters travel in `FrozenTarget.target_state`, placed by the run's sharding rules (the
arrays the frozen embedding and LM head also point to: nothing is copied). No gradient reaches them: the
forward runs before, not inside, the draft's vjp (`training.step.micro_step`), so none of its
activations are kept for a backward pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.cache.features import target_states
from dspark_jax.draft.model import FrozenTarget

ONLINE_DTYPES = ("bfloat16", "float32")


@dataclasses.dataclass(frozen=True)
class OnlineFeatures:
    """The step's feature pass: `(frozen, batch) -> batch` with the target's states added.

    graphdef: the target's (`nnx.split`); its state is `frozen.target_state`.
    packed: rows pack several samples (`data.pack`): the forward follows `positions`, else each row's real
      tokens (position 0 first, then positions > 0; padding has position 0).
    chunks: the forward runs over the rows in this many sequential pieces (`data.online_chunks`), so that
      only one piece's activations are live at a time.
    """

    graphdef: nnx.GraphDef
    aux_layer_ids: tuple[int, ...]
    packed: bool
    dtype: str = "bfloat16"
    chunks: int = 1

    def __call__(self, frozen: FrozenTarget, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        model = nnx.merge(self.graphdef, jax.lax.stop_gradient(frozen.target_state))

        def states(tokens_BxT, positions_BxT):
            if self.packed:
                rows = dict(positions_BxT=positions_BxT)
            else:
                rows = dict(valid_BxT=(positions_BxT > 0) | (jnp.arange(positions_BxT.shape[1]) == 0))
            dtype = jnp.dtype(self.dtype)
            return target_states(model, tokens_BxT, aux_layer_ids=self.aux_layer_ids, dtype=dtype, **rows)

        rows_BxT = (batch["input_ids"], batch["positions"])
        if self.chunks == 1:
            aux_BxTxAxH, last_BxTxH = states(*rows_BxT)
        else:  # piece c holds rows c, c + C, ...: a share of every batch shard's block of rows
            b = rows_BxT[0].shape[0]
            split = lambda x_Bx: x_Bx.reshape(b // self.chunks, self.chunks, *x_Bx.shape[1:]).swapaxes(0, 1)
            merge = lambda x_CxBx: x_CxBx.swapaxes(0, 1).reshape(b, *x_CxBx.shape[2:])
            pieces = jax.lax.map(lambda piece: states(*piece), tuple(split(x) for x in rows_BxT))
            aux_BxTxAxH, last_BxTxH = (merge(x) for x in pieces)
        return {**batch, "aux_hidden": aux_BxTxAxH, "last_hidden": last_BxTxH}


def online_features(config, model) -> OnlineFeatures:
    """The feature pass of an online run config for the target `model` (a `Transformer`)."""
    return OnlineFeatures(
        nnx.graphdef(model),
        tuple(config.data.aux_layer_ids),
        bool(config.data.get("pack", False)),
        config.data.get("online_dtype", "bfloat16"),
        config.data.get("online_chunks", 1),
    )
