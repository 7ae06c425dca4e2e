"""Mosaic GPU (Hopper) forward of the Pallas block attention: warpgroup tiles of query rows that read
context key tiles only up to their largest anchor.

Layout (letters: the legend in `dspark_jax/__init__.py`; inside the kernel `R` is the program's rows and
`K` the keys of one tile). Queries are regrouped per KV head, `[B, G, N*S*E, D]` with rows ordered
(block, slot, head of the group) and padded to whole tiles of `ROWS` = 64 rows (one warpgroup's WGMMA
tile), so a GQA group shares every key tile and a tile may cover parts of several blocks. Keys and
values of one (row, KV head) are one sequence: the context `[T]`, then each block's own slots and
memory side by side, `[N * (S + M)]`, each part padded to whole key tiles. Every key carries two
integers: its context position (`_FAR` for slots and memory) and its owning block (-1 for context, -2
for invalid memory and padding); every query row its block's anchor, sample start and block index.
Row `r` sees key `k` iff `start_r <= pos_k < anchor_r` or `owner_k == block_r` -- the visibility rule
of `reference.py`.

The grid is `(N*S*E / ROWS, G, B)`; program `(r, g, b)` owns one row tile and loops over two ranges
of key tiles, computed outside the kernel (the rows' context `[min start, max anchor)`, the anchors
being sorted; the local keys of the tile's first to last block) and read by the kernel from a small
per-tile record: no step for context past the largest anchor, none for other blocks' slots. Each step
copies one key tile, its values and its two integer rows from global to shared memory by TMA,
double-buffered (the next tile's copy is issued before the current one is used), then QK^T and PV by
WGMMA with fp32 accumulation and one online softmax (fp32 statistics) over both ranges.

Inputs are bf16 or f16 (WGMMA's 16-bit operands; fp32 would run as tf32, so the dispatcher keeps fp32
on the XLA path). Keys are passed transposed (`[B, G, D, T]` tiles), the one extra copy of K this
costs buys a kernel that GPU interpret mode also runs. `interpret=True` runs the kernel on the CPU
under `InterpretGPUParams` (JAX's simulation of shared memory, TMA and barriers); there the
register-layout annotations, which that simulation does not implement, are skipped.

The backward pass is `pallas.py`'s custom VJP (the chunked XLA path), as for the TPU kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dspark_jax.kernels.block_attention.common import NEG_INF, BlockMemory, per_kv_head

ROWS = 64  # query rows per program: one warpgroup's WGMMA tile
SMEM_BYTES = 227 * 1024  # shared memory per block on Hopper (H100, H200)
DTYPES = (jnp.bfloat16, jnp.float16)
_FAR = 2**30  # context position of a non-context key: outside every block's context range
_RECORD = 32  # int32 words of a tile's range record (one 128-byte TMA copy; four are used)


def supports(dtype) -> bool:
    """Whether the kernel takes inputs of `dtype` (16-bit WGMMA operands)."""
    return any(jnp.dtype(dtype) == jnp.dtype(t) for t in DTYPES)


def key_tile(block_k: int, d: int, itemsize: int) -> int:
    """The key tile: `block_k` rounded down to a multiple of 64, halved until the double-buffered K and V
    tiles, the query tile and the probabilities' tile fit in shared memory."""
    if d % 16:
        raise ValueError(
            f"the Mosaic GPU block attention kernel needs a head dim that is a multiple of 16, got {d}"
        )
    tile = max(64, block_k // 64 * 64)
    smem = lambda tile: (ROWS * d + 4 * tile * d + ROWS * tile) * itemsize  # Q, 2 x (K, V), P
    while tile > 64 and smem(tile) > SMEM_BYTES:
        tile //= 2
    if smem(tile) > SMEM_BYTES:
        raise ValueError(
            f"head dim {d} is too large for the Mosaic GPU block attention kernel's shared memory"
        )
    return tile


def _swizzled(shape, dtype):
    """A shared-memory buffer tiled and swizzled for WGMMA along its minor dimension."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(shape[-1] * itemsize * 8)
    transforms = (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def _kernel(record_ref, q_ref, kt_ref, v_ref, pos_ref, owner_ref, rows_ref, o_ref, *, block_k, interpret):
    """One row tile of one (row, KV head): context key tiles in range, then the tile's blocks' own slots
    and memory."""
    r, g, b = lax.axis_index("r"), lax.axis_index("g"), lax.axis_index("b")
    d = q_ref.shape[-1]
    layout = (lambda x, _: x) if interpret else plgpu.layout_cast
    load = (lambda ref, _: ref[...]) if interpret else (lambda ref, lay: plgpu.load(ref, (), layout=lay))
    row_layout, key_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
    across = lambda x_R: lax.broadcast_in_dim(x_R, (ROWS, block_k), [0])
    down = lambda x_K: lax.broadcast_in_dim(x_K, (ROWS, block_k), [1])

    def scoped(q_smem, kt_smem, v_smem, p_smem, pos_smem, owner_smem, rows_smem, record_smem, setup, kv_bars):
        plgpu.copy_gmem_to_smem(q_ref.at[b, g, pl.ds(r * ROWS, ROWS)], q_smem, setup.at[0])
        plgpu.copy_gmem_to_smem(rows_ref.at[b, :, pl.ds(r * ROWS, ROWS)], rows_smem, setup.at[1])
        plgpu.copy_gmem_to_smem(record_ref.at[b, r], record_smem, setup.at[2])
        for i in range(3):
            plgpu.barrier_wait(setup.at[i])
        ctx_lo, ctx_hi, local_lo, local_hi = (record_smem[i] for i in range(4))
        n_ctx = ctx_hi - ctx_lo
        steps = n_ctx + local_hi - local_lo
        anchor_R, start_R, block_R = (load(rows_smem.at[i], row_layout) for i in range(3))

        def fetch(step, slot):
            tile = jnp.where(step < n_ctx, ctx_lo + step, local_lo + step - n_ctx)
            keys = pl.ds(tile * block_k, block_k)
            plgpu.copy_gmem_to_smem(kt_ref.at[b, g, :, keys], kt_smem.at[slot], kv_bars.at[4 * slot])
            plgpu.copy_gmem_to_smem(v_ref.at[b, g, keys], v_smem.at[slot], kv_bars.at[4 * slot + 1])
            plgpu.copy_gmem_to_smem(pos_ref.at[b, keys], pos_smem.at[slot], kv_bars.at[4 * slot + 2])
            plgpu.copy_gmem_to_smem(owner_ref.at[b, keys], owner_smem.at[slot], kv_bars.at[4 * slot + 3])

        @pl.when(steps > 0)
        def _():
            fetch(0, 0)

        def step(i, carry):
            m_R, l_R, acc_RxD = carry
            slot = lax.rem(i, 2)

            @pl.when(i + 1 < steps)
            def _():
                fetch(i + 1, 1 - slot)  # that buffer's last reader, step i - 1, has finished

            for j in range(4):
                plgpu.barrier_wait(kv_bars.at[4 * slot + j])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, kt_smem.at[slot])
                return acc_ref[...]

            scores_RxK = pl.run_scoped(qk, plgpu.ACC((ROWS, block_k), jnp.float32))
            pos_K, owner_K = load(pos_smem.at[slot], key_layout), load(owner_smem.at[slot], key_layout)
            visible = ((down(pos_K) >= across(start_R)) & (down(pos_K) < across(anchor_R))) | (
                down(owner_K) == across(block_R)
            )
            scores_RxK = jnp.where(visible, scores_RxK, NEG_INF)
            m_new = jnp.maximum(m_R, scores_RxK.max(axis=1))
            p_RxK = jnp.where(visible, jnp.exp(scores_RxK - across(m_new)), 0.0)
            alpha_R = jnp.exp(m_R - m_new)

            p_smem[...] = p_RxK.astype(p_smem.dtype)
            plgpu.commit_smem()

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                return acc_ref[...]

            pv_RxD = pl.run_scoped(pv, plgpu.ACC((ROWS, d), jnp.float32))
            acc_RxD = acc_RxD * lax.broadcast_in_dim(alpha_R, (ROWS, d), [0]) + pv_RxD
            return m_new, alpha_R * l_R + p_RxK.sum(axis=1), acc_RxD

        init = (
            layout(jnp.full((ROWS,), NEG_INF, jnp.float32), row_layout),
            layout(jnp.zeros((ROWS,), jnp.float32), row_layout),
            layout(jnp.zeros((ROWS, d), jnp.float32), plgpu.Layout.WGMMA),
        )
        _, l_R, acc_RxD = lax.fori_loop(0, steps, step, init)
        l_R = jnp.where(l_R > 0, l_R, 1.0)  # padding rows see nothing: zeros, not 0/0
        q_smem[...] = (acc_RxD / lax.broadcast_in_dim(l_R, (ROWS, d), [0])).astype(q_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[b, g, pl.ds(r * ROWS, ROWS)])
        plgpu.wait_smem_to_gmem(0)

    dtype = q_ref.dtype
    pl.run_scoped(
        scoped,
        _swizzled((ROWS, d), dtype),
        _swizzled((2, d, block_k), dtype),
        _swizzled((2, block_k, d), dtype),
        _swizzled((ROWS, block_k), dtype),
        plgpu.SMEM((2, block_k), jnp.int32),
        plgpu.SMEM((2, block_k), jnp.int32),
        plgpu.SMEM((3, ROWS), jnp.int32),
        plgpu.SMEM((_RECORD,), jnp.int32),
        plgpu.Barrier(num_barriers=3),
        plgpu.Barrier(num_barriers=8),
    )


def _pad_to(x, axis: int, multiple: int, value=0):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, -x.shape[axis] % multiple)
    return jnp.pad(x, pad, constant_values=value)


def tile_ranges(
    rows_Bx3xNSE, n: int, rows_per_block: int, keys_per_block: int, t: int, tile: int
) -> jax.Array:
    """int32 `[B, N*S*E / ROWS, 4]`: per row tile, its context key tiles `[lo, hi)` (from the rows' smallest
    sample start to their largest anchor; empty when no row sees context) and its local key tiles `[lo,
    hi)` (the slots and memory of the tile's first to last block), as indices into the key sequence."""
    b, _, padded = rows_Bx3xNSE.shape
    row_tiles = padded // ROWS
    t_tiles = (t + tile - 1) // tile
    real_row = (jnp.arange(padded) < n * rows_per_block).reshape(row_tiles, ROWS)
    tiled = lambda x_BxNSE: x_BxNSE.reshape(b, row_tiles, ROWS)
    ctx_hi = jnp.max(jnp.where(real_row, tiled(rows_Bx3xNSE[:, 0]), 0), axis=-1)
    ctx_lo = jnp.minimum(jnp.min(jnp.where(real_row, tiled(rows_Bx3xNSE[:, 1]), t), axis=-1), ctx_hi)
    ctx_lo_tile = ctx_lo // tile
    ctx_hi_tile = jnp.where(ctx_hi > ctx_lo, (ctx_hi + tile - 1) // tile, ctx_lo_tile)
    first_block = jnp.arange(row_tiles) * ROWS // rows_per_block
    last_block = jnp.minimum((jnp.arange(row_tiles) * ROWS + ROWS - 1) // rows_per_block, n - 1)
    local = lambda x_I: jnp.broadcast_to(t_tiles + x_I, ctx_lo.shape)
    local_lo = local(first_block * keys_per_block // tile)
    local_hi = local(((last_block + 1) * keys_per_block + tile - 1) // tile)
    return jnp.stack([ctx_lo_tile, ctx_hi_tile, local_lo, local_hi], axis=-1).astype(jnp.int32)


def forward(
    q, k_ctx, v_ctx, k_blk, v_blk, anchors, starts, memory: BlockMemory | None, block_k: int, interpret: bool
):
    """Block attention `[B, N, S, Q, D]` by the Mosaic GPU kernel (inputs: `block_attention`'s)."""
    b, n, s, heads, d = q.shape
    t, g = k_ctx.shape[1], k_ctx.shape[2]
    e = heads // g
    tile = key_tile(block_k, d, q.dtype.itemsize)
    rows = n * s * e
    q_BxGxNSExD = q.reshape(b, n, s, g, e, d).transpose(0, 3, 1, 2, 4, 5).reshape(b, g, rows, d)
    q_BxGxNSExD = _pad_to((q_BxGxNSExD.astype(jnp.float32) * d**-0.5).astype(q.dtype), 2, ROWS)
    row_tiles = q_BxGxNSExD.shape[2] // ROWS

    # Keys of one (row, KV head): the context, then per block its S own slots and M memory slots.
    m = 0 if memory is None else memory.valid_BxNxM.shape[2]
    local_k, local_v = k_blk, v_blk
    block_N = jnp.arange(n, dtype=jnp.int32)
    owner_local = jnp.broadcast_to(block_N[:, None], (b, n, s))  # [B, N, S + M]: each local key's block
    if memory is not None:
        local_k = jnp.concatenate([k_blk, memory.k_BxNxMxGxD.astype(k_blk.dtype)], axis=2)
        local_v = jnp.concatenate([v_blk, memory.v_BxNxMxGxD.astype(v_blk.dtype)], axis=2)
        owner_mem = jnp.where(memory.valid_BxNxM, block_N[None, :, None], -2)
        owner_local = jnp.concatenate([owner_local, owner_mem.astype(jnp.int32)], axis=2)
    keys = lambda ctx, local: jnp.concatenate(
        [_pad_to(per_kv_head(ctx), 2, tile), _pad_to(per_kv_head(local), 2, tile)], axis=2
    )
    kt_BxGxDxT = keys(k_ctx, local_k).transpose(0, 1, 3, 2)  # T here: all keys, context then local
    v_BxGxTxD = keys(v_ctx, local_v)
    t_pad = t + (-t % tile)
    pos_BxT = jnp.broadcast_to(jnp.arange(t_pad, dtype=jnp.int32), (b, t_pad))
    pos_BxT = jnp.concatenate([pos_BxT, jnp.full((b, kt_BxGxDxT.shape[3] - t_pad), _FAR, jnp.int32)], axis=1)
    owner_BxT = jnp.concatenate(
        [jnp.full((b, t_pad), -1, jnp.int32), _pad_to(owner_local.reshape(b, -1), 1, tile, -2)], axis=1
    )

    # Per query row: its block's anchor, sample start and index; padding rows see nothing.
    per_row = lambda x_BxN, fill: _pad_to(jnp.repeat(x_BxN.astype(jnp.int32), s * e, axis=1), 1, ROWS, fill)
    rows_Bx3xNSE = jnp.stack(
        [per_row(anchors, 0), per_row(starts, 0), per_row(jnp.broadcast_to(block_N, (b, n)), -3)], axis=1
    )

    record = _pad_to(tile_ranges(rows_Bx3xNSE, n, s * e, s + m, t, tile), 2, _RECORD)

    call = plgpu.kernel(
        functools.partial(_kernel, block_k=tile, interpret=bool(interpret)),
        out_type=jax.ShapeDtypeStruct(q_BxGxNSExD.shape, q.dtype),
        grid=(row_tiles, g, b),
        grid_names=("r", "g", "b"),
        interpret=_interpret_params() if interpret else False,
    )
    out = call(record, q_BxGxNSExD, kt_BxGxDxT, v_BxGxTxD, pos_BxT, owner_BxT, rows_Bx3xNSE)
    out = out[:, :, :rows].reshape(b, g, n, s, e, d).transpose(0, 2, 3, 1, 4, 5)
    return out.reshape(b, n, s, heads, d)


def _interpret_params():
    """JAX's GPU interpret mode (not exported by `jax.experimental.pallas.mosaic_gpu` in JAX 0.10)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()
