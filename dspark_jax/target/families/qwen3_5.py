"""Qwen 3.5 and Qwen 3.5-MoE: Qwen3-Next's hybrid layers with the DeltaNet projections stored part by part
(`[q; k; v]`, `z`, `b`, `a`); the MoE model routes its MLPs through experts plus a gated shared expert. The
multimodal checkpoints nest the text model's config under `text_config` (model_type `qwen3_5_text`)."""

import dataclasses

from dspark_jax.target.families.registry import Family, LinearProjections, register

QWEN3_5 = register(
    Family(
        name="qwen3_5",
        model_types=("qwen3_5", "qwen3_5_text"),
        qk_norm=True,
        linear_projections=LinearProjections(
            tensors=(
                ("in_proj_qkv", ("q", "k", "v")),
                ("in_proj_z", ("z",)),
                ("in_proj_b", ("b",)),
                ("in_proj_a", ("a",)),
            )
        ),
        attn_output_gate=True,
        norm_unit_offset=True,
    )
)
QWEN3_5_MOE = register(
    dataclasses.replace(
        QWEN3_5,
        name="qwen3_5_moe",
        model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
        moe=True,
        shared_expert=True,
    )
)
