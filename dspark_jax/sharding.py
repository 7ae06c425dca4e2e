"""All sharding decisions: the mesh, the logical-axis rules table, and placing state on it.

Parameters carry logical axis names in their `axes` metadata (e.g. `('embed', 'mlp')`).
A rules table maps each logical name to mesh axes of the `('data', 'fsdp', 'tensor')`
mesh. A dimension that the mapped mesh axes do not divide evenly stays replicated, so the
same model runs on 1 CPU, 8 fake CPU devices, a GPU or a TPU slice.

A run takes its table from its config (`run.config_lib.sharding_rules`; default `DEFAULT_RULES`).
Activations are pinned with `constrain(x, logical_axes)` at the block, chunk and logits boundaries; it acts
inside `activation_sharding(mesh, rules)` (the trainer and evaluator trace their steps inside
one) and is the identity elsewhere, so model code runs unchanged on one device.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axes. Parameters: 'embed' is FSDP-sharded, head/MLP/vocab axes
# tensor-parallel. Activations: 'batch' spans the data-parallel axes. A sparse target's routed experts
# (`[X, H, I]`, axes ('expert', 'embed', 'mlp')) are split whole over 'fsdp' (expert parallelism: each
# device holds X / n experts and `expert_parallel` brings the tokens to them; their 'embed' axis then stays
# whole, 'fsdp' being taken). `('expert', None)` keeps every expert on every device, sliced along H like
# any SwiGLU weight, and leaves the experts' partitioning to XLA.
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("seq", None),
    ("layers", None),
    ("aux", None),
    ("rank", None),
    ("expert", "fsdp"),
)

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]


_ACTIVE: list[tuple[Mesh, Rules]] = []


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Iterator[None]:
    """Within the context, `constrain` pins traced activations to `mesh` by `rules`."""
    _ACTIVE.append((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.pop()


def tracing(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> contextlib.AbstractContextManager:
    """The context a program outside the trainer (the cache builder's forward, generation) is traced in:
    `activation_sharding(mesh, rules)` on a multi-device mesh (so that, e.g., a sparse target's experts
    run expert-parallel), nothing on one device, where a constraint would change only XLA's fusions."""
    return activation_sharding(mesh, rules) if mesh.size > 1 else contextlib.nullcontext()


def _active() -> bool:
    """An activation sharding is active and this is not a `shard_map` body (no manual mesh axes)."""
    return bool(_ACTIVE) and not jax.sharding.get_abstract_mesh().manual_axes


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """`x` with a sharding constraint from its logical axes (identity outside `activation_sharding`, and
    inside `per_shard`, where every array is one device's shard)."""
    if not _active():
        return x
    mesh, rules = _ACTIVE[-1]
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, logical_to_spec(axes, x.shape, mesh, rules))
    )


def constrain_rows(x_Bx: jax.Array) -> jax.Array:
    """`x` pinned to its rows' batch shards, the other axes whole: `constrain(x, ("batch", None, ...))`, but
    the identity on a one-device mesh, where the constraint would change nothing but where XLA cuts its
    fusions (and so the float sums' order)."""
    if not _active() or _ACTIVE[-1][0].size == 1:
        return x_Bx
    return constrain(x_Bx, ("batch",) + (None,) * (x_Bx.ndim - 1))


def constrain_state(state: nnx.State) -> nnx.State:
    """An NNX state (parameters, or gradients shaped like them) pinned to its variables' `axes` layout
    (identity where `constrain` is): FSDP gradients reduce-scattered to their shards, not all-reduced to a
    whole copy on every device. Variables without a value (a `split_trainable` half) stay as they are."""
    if not _active():
        return state
    mesh, rules = _ACTIVE[-1]

    def one(variable: nnx.Variable):
        value = variable.get_value()
        if value is None:
            return variable
        spec = logical_to_spec(variable.get_metadata().get("axes"), value.shape, mesh, rules)
        return variable.replace(jax.lax.with_sharding_constraint(value, NamedSharding(mesh, spec)))

    return jax.tree.map(one, state, is_leaf=_is_variable)


def per_shard(fn, in_axes, out_axes: Sequence[str | None]):
    """`fn` run on each device's shard (`jax.shard_map`) under an active multi-device
    `activation_sharding`; `fn` itself elsewhere.

    For computations XLA cannot partition itself, such as Pallas (Mosaic) kernels. `in_axes` is one entry
    per positional argument: a tuple of logical axes for an array, or a pytree of such tuples for a pytree
    argument (None args take None). Only the 'batch' logical axis is split; every other axis is whole on
    each device (an argument sharded along it, e.g. heads over 'tensor', is gathered first), so `fn` must
    be independent across batch rows.
    """
    if not _ACTIVE or _ACTIVE[-1][0].size == 1:
        return fn
    mesh, rules = _ACTIVE[-1]
    is_axes = lambda x: isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)

    def wrapped(*args):
        batch_only = lambda axes: tuple(a if a == "batch" else None for a in axes)
        spec = lambda axes, x: logical_to_spec(batch_only(axes), x.shape, mesh, rules)
        in_specs = tuple(
            jax.tree.map(spec, axes, arg, is_leaf=is_axes) if arg is not None else None
            for axes, arg in zip(in_axes, args, strict=True)
        )
        out_spec = spec(out_axes, jax.eval_shape(fn, *args))
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)(*args)

    return wrapped


def _axis_names(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """The mesh axis names of one `PartitionSpec` entry."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def expert_parallel(fn):
    """`fn(x_TxH, ids_TxK, weights_TxK, gate_XxHxI, up_XxHxI, down_XxIxH, first_expert=0) -> y_TxH` (routed
    experts: each token's weighted sum over its picks of the `X` experts from `first_expert`) run
    expert-parallel where an active `activation_sharding`'s rules split the 'expert' axis over mesh axes;
    `fn` itself elsewhere.

    Under `jax.shard_map`, each device holds `X / n` whole experts (`n` devices along those axes) and its
    rows of tokens (the 'batch' axes). The tokens of the devices sharing the expert axes are all-gathered,
    each device computes its own experts' share for all of them (`first_expert` = its index x `X / n`), and
    the shares are reduce-scattered back to the tokens' devices: every pick reaches its expert, nothing is
    dropped, and no expert's weights move. Expert axes that do not split the tokens (tokens replicated
    along them) take a plain sum instead. The other weight axes are whole on each device (gathered first
    where the rules split them).
    """

    def wrapped(x_TxH, ids_TxK, weights_TxK, gate_XxHxI, up_XxHxI, down_XxIxH):
        args = (x_TxH, ids_TxK, weights_TxK, gate_XxHxI, up_XxHxI, down_XxIxH)
        if not _active():
            return fn(*args)
        mesh, rules = _ACTIVE[-1]
        expert_spec = logical_to_spec(("expert",), gate_XxHxI.shape[:1], mesh, rules)[0]
        if expert_spec is None:
            return fn(*args)
        expert_axes = _axis_names(expert_spec)
        rows_spec = logical_to_spec(("batch", None), x_TxH.shape, mesh, rules)[0]
        gathered = tuple(a for a in _axis_names(rows_spec) if a in expert_axes)
        summed = tuple(a for a in expert_axes if a not in gathered)

        def shard(x_TxH, ids_TxK, weights_TxK, gate_XxHxI, up_XxHxI, down_XxIxH):
            if gathered:
                x_TxH, ids_TxK, weights_TxK = (
                    jax.lax.all_gather(a, gathered, axis=0, tiled=True) for a in (x_TxH, ids_TxK, weights_TxK)
                )
            first = jax.lax.axis_index(expert_axes) * gate_XxHxI.shape[0]
            y_TxH = fn(x_TxH, ids_TxK, weights_TxK, gate_XxHxI, up_XxHxI, down_XxIxH, first_expert=first)
            if gathered:
                y_TxH = jax.lax.psum_scatter(y_TxH, gathered, scatter_dimension=0, tiled=True)
            return jax.lax.psum(y_TxH, summed) if summed else y_TxH

        rows = PartitionSpec(rows_spec, None)
        experts = PartitionSpec(expert_spec, None, None)
        return jax.shard_map(
            shard,
            mesh=mesh,
            in_specs=(rows, rows, rows, experts, experts, experts),
            out_specs=rows,
            check_vma=False,
        )(*args)

    return wrapped


def make_mesh(shape: Mapping[str, int] | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the `('data', 'fsdp', 'tensor')` mesh.

    `shape` gives the size of each axis; one size may be -1 to take the remaining devices.
    By default every device goes to 'fsdp'. A mesh smaller than the device list uses the
    first devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = dict(shape or {"data": 1, "fsdp": -1, "tensor": 1})
    unknown = set(shape) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; the mesh axes are {MESH_AXES}")
    sizes = [int(shape.get(name, 1)) for name in MESH_AXES]
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {shape}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"mesh {shape} does not divide {len(devices)} devices")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) > len(devices):
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, have {len(devices)}"
        )
    return Mesh(np.asarray(devices[: math.prod(sizes)]).reshape(sizes), MESH_AXES)


def logical_to_spec(
    axes: Sequence[str | None] | None, shape: Sequence[int], mesh: Mesh, rules: Rules = DEFAULT_RULES
) -> PartitionSpec:
    """PartitionSpec for one array from its logical axes, skipping mesh axes that don't divide it.

    Each mesh axis is used at most once per array (first logical axis wins).
    """
    if axes is None:
        return PartitionSpec()
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {tuple(axes)} do not match array shape {tuple(shape)}")
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name, dim in zip(axes, shape):
        if name is not None and name not in table:
            raise KeyError(f"logical axis {name!r} has no entry in the sharding rules {sorted(table)}")
        target = table.get(name) if name is not None else None
        mesh_axes = (target,) if isinstance(target, str) else tuple(target or ())
        chosen = []
        for mesh_axis in mesh_axes:
            size = mesh.shape[mesh_axis]
            if mesh_axis in used or size == 1:
                continue
            if dim % (math.prod(mesh.shape[a] for a in chosen) * size):
                continue
            chosen.append(mesh_axis)
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return PartitionSpec(*spec)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(state: nnx.State, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.State:
    """NamedSharding for every variable of an NNX state, from its `axes` metadata."""

    def one(variable: nnx.Variable):
        axes = variable.get_metadata().get("axes")
        return NamedSharding(mesh, logical_to_spec(axes, variable.get_value().shape, mesh, rules))

    return jax.tree.map(one, state, is_leaf=_is_variable)


def with_shardings(state: nnx.State, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.State:
    """An abstract NNX state (`ShapeDtypeStruct` values) whose values carry their shardings, for restores."""

    def one(variable: nnx.Variable):
        value = variable.get_value()
        spec = logical_to_spec(variable.get_metadata().get("axes"), value.shape, mesh, rules)
        return variable.replace(
            jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=NamedSharding(mesh, spec))
        )

    return jax.tree.map(one, state, is_leaf=_is_variable)


def device_bytes(tree) -> int:
    """Bytes of one device's shards of the leaves of `tree` (arrays or `ShapeDtypeStruct`s carrying a
    sharding, e.g. from `with_shardings`)."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
    )


def shard_batch(x: jax.Array | np.ndarray, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> jax.Array:
    """Places a batch-major array on the mesh: leading dim over the 'batch' mesh axes when they divide it."""
    spec = logical_to_spec(("batch",) + (None,) * (np.ndim(x) - 1), np.shape(x), mesh, rules)
    return jax.device_put(x, NamedSharding(mesh, spec))
