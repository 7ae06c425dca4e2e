"""The positive control of Draft Memory's memory path: a perfect stage 1 (`draft.memory_states='target'`, the
target's own final states in the memory slots, the first of them the teacher of the block's first
prediction) must be read. A smoke run trained with it loses tau_prob when its memory is masked (+0.115
[> 0] as built); a memory path that drops its keys (0.000) or zeroes the adapter's output (+0.0007, interval
across 0) shows no such gain. Slots at consistently shifted RoPE positions (+3) still pass: a constant
offset is learnable; their placement is `test_memory.py`'s float64 reference's to check (it fails at +1)."""

import pytest

from configs import memory
from dspark_jax.training.loop import train

STEPS = 150


@pytest.fixture(scope="module")
def perfect_memory_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("memory_control")
    config = memory.get_config("smoke")
    config.data.cache_dir = str(root / "caches")
    config.mesh.fsdp = 1
    config.draft.memory_states = "target"
    config.data.regen_max_new_tokens = 48  # replies long enough for memory slots past the new anchors
    config.data.train_limit = 16
    config.train.total_steps = config.train.stop_step = config.train.eval_every = STEPS
    config.train.checkpoint_every = STEPS
    config.train.peak_lr = 3e-3
    config.train.eval_batches = 0
    return train(config, root / "run")


def test_a_perfect_memory_is_read(perfect_memory_run):
    """Masking the perfect memory costs tau_prob, told apart from noise over the validation samples."""
    m = perfect_memory_run
    gain = m["eval/memory_gain"]
    assert m["eval/memory_gain_low95"] > 0, (gain, m["eval/memory_gain_low95"])
    assert gain > 0.05, (m["eval/tau_prob"], m["eval/tau_prob_without_memory"])
