"""Draft Memory (experiment group 5): two-stage training, last-round draft states as memory.

  python -m dspark_jax.train --config=configs/memory.py            # :demo, SmolLM2 on CPU (~30 min, fresh)
  python -m dspark_jax.train --config=configs/memory.py:smoke      # tiny random target (seconds)
  python -m dspark_jax.train --config=configs/memory.py:paper \\
      --config.target.path=/path/to/Qwen3.8-Flash-Next --config.data.cache_dir=gs://bucket/dspark

Same presets, caches and loss as configs/baseline.py (the demo reuses the baseline demo's caches); the
draft gains the memory adapter (`P`, `gamma`; 6,556,160 parameters at paper shapes). Extra key:
  draft.memory_source   inference only: 'with_memory' (the round's own memory-conditioned states feed the
                        next round, as inference naturally runs) or 'no_memory' (one extra memory-free
                        draft pass per round, the source training's stage 1 uses) or 'disabled' (no
                        memory: an ablation of the same weights); also
                        `python -m dspark_jax.speculate --memory_source=...`.
  draft.memory_states   training and evaluation: 'draft' (stage 1's own states, the seed's group) or
                        'target' (the target's final states at the same slots: a perfect stage 1, the
                        positive control of the memory path and the upper bound of what a memory adds;
                        decoding still reads the draft's own states).
"""

from configs import base


def get_config(preset: str = "demo"):
    config = base.get_config(preset)
    with config.unlocked():
        config.experiment = "memory"
        config.draft.memory_source = "with_memory"
        config.draft.memory_states = "draft"
    return config
