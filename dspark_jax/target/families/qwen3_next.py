"""Qwen3-Next: hybrid layers, Gated DeltaNet ("linear_attention") or full attention with a sigmoid output
gate and partial rotary embedding; RMSNorm scales are `1 + weight`; its MLPs route through experts plus
a gated shared expert. Its checkpoints fuse the DeltaNet projections into two tensors, key head by key
head."""

from dspark_jax.target.families.registry import Family, LinearProjections, register

QWEN3_NEXT = register(
    Family(
        name="qwen3_next",
        model_types=("qwen3_next",),
        qk_norm=True,
        linear_projections=LinearProjections(
            tensors=(("in_proj_qkvz", ("q", "k", "v", "z")), ("in_proj_ba", ("b", "a"))), per_key_head=True
        ),
        attn_output_gate=True,
        norm_unit_offset=True,
        moe=True,
        shared_expert=True,
    )
)
