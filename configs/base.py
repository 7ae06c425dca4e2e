"""Base configuration: the seed's table (the paper setting), plus the `demo`, `accel` and `smoke` presets.

Experiment configs (`configs/baseline.py`, ...) call `get_config(preset)` and add their own
keys. Presets:
  paper  the seed: Qwen3.8-Flash-Next target (a hybrid Gated-DeltaNet MoE of depth 52, `PAPER_TARGET`; set
         `target.path` and `data.cache_dir`), draft hidden 2560, 24/2 heads x 256, FFN 9728, aux layers
         45-47, 4096 tokens, 512 anchors, global batch 512 = 4 devices x micro-batch 4 x accumulation
         32, 26,040-step schedule stopping at 2,604, checkpoint every 651, bf16 compute, seed 42.
  demo   the embedded default target SmolLM2-135M-Instruct with a ShareGPT demo cache, CPU, minutes.
  accel  the same target and draft on one accelerator (one GPU or one TPU host): 4,000 regenerated
         ShareGPT conversations, packed rows of 2,048 tokens, 2,000 steps; sized for about 15
         minutes (`benchmarks/accel_demo.py` runs it end to end).
  smoke  a tiny randomly initialised target with SmolLM2's tokenizer; seconds on CPU.

Keys:
  experiment                name of the experiment group ('baseline', ...).
  seed                      global seed (init, data order, anchors).
  target.path               HF directory or GGUF file of the target; '' = the embedded default.
  target.name               human-readable target name (reports only).
  target.random_init        build a random target of shape `target.arch` (tests and smoke runs; the
                            tokenizer still comes from `target.path`).
  target.arch.*             the target's shape (TargetConfig fields): built when `random_init` is set, and
                            used by shape-only tools (check_memory, benchmarks --shape_only).
  target.param_dtype        storage dtype of target weights ('float32' or 'bfloat16').
  target.dtype              compute dtype of target activations.
  mesh.data/fsdp/tensor     mesh axis sizes; one may be -1 to take the remaining devices.
  sharding.rules            logical axis -> mesh axes table for parameters and activations
                            (default: `dspark_jax.sharding.DEFAULT_RULES`).
  generate.batch_size       rows per compiled generation program.
  generate.max_new_tokens   generation length cap per turn.
  generate.temperature      0 = greedy.
  generate.top_p            nucleus sampling mass.
  generate.padding          'left' or 'right' prompt alignment.
  generate.select_top_k     speculative decoding: each draft token is chosen among its slot's K best base
                            logits, the Markov correction computed for those K only (0 = the whole
                            vocabulary, as in training; lossless either way).
  generate.draft_len        speculative decoding: proposals drafted and verified at most per cycle, the
                            block's first L slots (0 = all `draft.block_size`); shorter pays where a
                            verification forward's cost grows fast with its width (a CPU).
  generate.draft_vocab      speculative decoding: the draft proposes only the N tokens the run's training
                            responses use most (their N columns of the LM head are all a selection reads;
                            0 = the vocabulary the draft trained on, `train.draft_vocab`; lossless either
                            way).
  data.cache_dir            root of the caches and regenerated replies; '' = $DSPARK_JAX_CACHE or
                            ~/.cache/dspark_jax, then `<preset>/<target fingerprint>` below it.
  data.train_cache          an existing cache to train on (dspark_jax or DeepSpec v2 format, local or
                            gs://); '' = the cache built from `data.train_source` under `data.cache_dir`.
  data.val_cache            the same for validation.
  data.train_source         'sharegpt' (the PyPI package), a packaged prompt file by name ('gsm8k_rest',
                            'mt_bench': dspark_jax/data/README.md), a conversation file (JSON/JSONL),
                            or a blend 'SOURCE=WEIGHT,...' (e.g. 'sharegpt=3,gsm8k_rest=1': each
                            source's share of `data.train_limit`, interleaved).
  data.train_limit          first N usable training conversations (0 = all).
  data.val_source           validation prompts; '' = the packaged GSM8K-256 ('mt_bench' = MT-Bench).
  data.val_limit            first N validation prompts (0 = all).
  data.aux_layer_ids        target layers cached as draft context, DeepSpec's `target_layer_ids` (layer k's
                            output; -1 = embedding output). Never the target's last layer: no serving engine
                            captures it (refused before any work, naming the engines; `tap_last_layer`).
  data.tap_last_layer       let `aux_layer_ids` include the target's last layer anyway (a warning names the
                            engines that cannot serve the draft; `export` still refuses it for them).
  data.max_length           tokens per row (prompt + response); longer samples are truncated.
  data.pack                 pack several whole samples per row (each block sees only its own sample's
                            context; `train.global_batch` and `train.num_anchors` then count rows).
  data.num_shards           cache shards (parallel build units; fixed per cache).
  data.regenerate           True: the target regenerates every assistant reply (on-policy text, the
                            default); False: the source's own replies are the text (no generation: the
                            cache costs one target forward a sample), the target's distribution over it
                            still the teacher. Prompt-only sources (GSM8K) have no reply to keep.
  data.regen_max_new_tokens reply length cap when the target regenerates replies.
  data.regen_max_prompt_tokens  prompt length cap per regenerated turn.
  data.regen_batch_size     rows per regeneration program.
  data.regen_chunk_size     conversations per durable write of the replies (what a killed run redoes at most);
                            each chunk's prompts are batched shortest first, so a chunk of several batches
                            pads the prefill less (demo: 256 against 64, 116,736 prompt slots for the train
                            split's 64,200 prompt tokens against 155,648).
  data.regen_max_turns      user turns kept per conversation (later turns are dropped).
  data.worker_count         grain worker processes preparing training batches (0 = in process).
  data.features             'offline': the draft reads the target's states from the cache; 'online': the
                            cache holds token rows only and every micro-step runs the frozen target
                            over its batch (no states written; `dspark_jax.training.online`).
  data.online_dtype         online only: the dtype the target's states are rounded to before the draft
                            reads them; 'bfloat16' (the cache's storage dtype: online = offline) or
                            'float32' (full precision).
  data.online_chunks        online only: the target's forward runs over each micro-batch in this many
                            sequential pieces (1 = all rows at once), each a share of every batch
                            shard's rows, so its activations live one piece at a time; divides the
                            micro-batch rows (train.global_batch / train.grad_accum).
  draft.num_layers          draft decoder layers (3).
  draft.num_heads/num_kv_heads/head_dim/intermediate_size   draft layer shape (hidden = target's).
  draft.block_size          slots per block: anchor + 6 MASK (7).
  draft.markov_rank         rank of the Markov head (256).
  draft.mask_token_id       target embedding row used as MASK; -1 = a learned vector (no serving engine
                            loads one: `python -m dspark_jax.export` refuses it). The paper's 151669 is
                            Qwen3's reserved `<|MASK|>` row; the SmolLM2 presets' 16 is `<empty_output>`, a
                            Jupyter-format special token its chat never emits (0 of 211k tokens of the
                            demo caches; `SMOLLM2_MASK_ROW`).
  draft.param_dtype         master weights dtype ('float32').
  draft.dtype               compute dtype ('bfloat16' on accelerators, 'float32' on CPU).
  draft.attention           block attention: 'xla' (chunked), 'pallas' (TPU kernel; XLA elsewhere, logged),
                            'auto' (Pallas where it compiles) or 'reference' (dense, tests).
  draft.attention_block_q   Pallas block attention: blocks per query tile (`BlockSizes.block_q`; 8); with
                            'pallas'/'auto', block_q x block_size must be a multiple of 8 (TPU sublanes).
  draft.attention_block_k   Pallas block attention: context positions per key tile (`BlockSizes.block_k`;
                            128); with 'pallas'/'auto', a multiple of 8.
  draft.anchor_chunk        blocks per chunk in block attention and in the vocabulary-sized loss.
  draft.remat               recompute each chunk in the backward pass (memory-bounded) instead of keeping
                            its activations (one forward less; the CPU presets' choice).
  train.num_anchors         anchors drawn per sample (512).
  train.global_batch        samples per optimizer step, all devices and micro-batches (512).
  train.grad_accum          micro-batches per optimizer step (32).
  train.total_steps         length of the LR schedule (26,040).
  train.stop_step           where the run stops (2,604: one epoch); the schedule keeps its full length.
  train.peak_lr             AdamW peak learning rate (3e-4).
  train.warmup_fraction     linear warmup share of `total_steps` (0.04).
  train.weight_decay        AdamW weight decay (0).
  train.draft_vocab         the draft's logits cover only the K tokens the training responses use most (plus
                            EOS), the teacher keeps the whole vocabulary (L1 counts its mass outside; a label
                            outside adds no CE): the draft's vocabulary-sized work shrinks V/K-fold; decoding
                            proposes from the same K tokens (0 = the whole vocabulary, 49,152 for SmolLM2;
                            demo 8,192: its responses use ~5,000 distinct tokens, and its step takes half the
                            time, eval tau_prob 1.848 against 1.782: results/demo-vocab-2026-12-05).
  train.clip_norm           global gradient-norm clip (1.0).
  train.copied_lr_scale     the learning rate of the parameters that start from the target's
                            (`init.from_target_layers`, `init.context_from_aux`) over `peak_lr`'s (1.0).
  train.b1/b2/eps           AdamW moments.
  train.checkpoint_every    steps between orbax checkpoints (651).
  train.max_to_keep         checkpoints kept.
  train.log_every           steps between metric lines.
  train.eval_every          steps between validation evaluations (0 = only at the end).
  train.eval_batches        validation batches per evaluation (0 = the whole validation cache).
  train.ablate_every_eval   measure the evaluation's ablations (tau_prob without the target context, and a
                            group's own: `Experiment.report.evaluation_ablations`, one forward each) at every
                            evaluation; False = at the run's last one only.
  train.seed                the draft's initialisation and the training data order (None = `seed`): runs
                            of one experiment with other `train.seed`s share the caches, the target and
                            the validation batches (a suite's `--seeds`).
  init.from_target_layers   target layer ids (one per draft layer, negative from the top; None = random
                            init) whose norms, attention projections and MLP the draft's layers start
                            from (the draft's layer shape must be the target's: num_heads, num_kv_heads,
                            head_dim, intermediate_size; q/k norms the target lacks keep their init).
  init.context_from_aux     with `from_target_layers`: the context projection starts as the identity on this
                            aux layer (an index into `data.aux_layer_ids`, -1 = the last) and its norm as the
                            first copied layer's input norm, so that layer reads the context as the target
                            reads its own input (None = a random projection).
"""

from ml_collections import config_dict

from dspark_jax import sharding

# The embedded default target's shape (SmolLM2-135M-Instruct; shape-only tools need no GGUF).
DEMO_TARGET = dict(
    family="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    bos_token_id=1,
    eos_token_ids=(2,),
)
# SmolLM2's `<empty_output>`: the MASK row of the demo, accel and smoke drafts (DeepSpec's convention, a
# target row the target never emits, so the exported draft runs in vLLM and SGLang as it was trained).
SMOLLM2_MASK_ROW = 16
# A tiny random target with SmolLM2's vocabulary (and tokenizer), for tests and smoke runs.
SMOKE_TARGET = dict(
    DEMO_TARGET, hidden_size=64, intermediate_size=128, num_layers=5, num_heads=4, num_kv_heads=2, head_dim=16
)
# SMOKE_TARGET made Qwen3-Next-shaped: Gated DeltaNet layers with a gated full-attention layer as every 4th
# (the aux layers 1-3 are of both kinds, and inner: a layer follows them), every MLP 2 of 8 experts plus a
# shared expert; for tests of hybrid targets.
SMOKE_HYBRID_TARGET = dict(
    SMOKE_TARGET,
    family="qwen3_next",
    layer_types=("linear_attention",) * 3 + ("full_attention", "linear_attention"),
    attn_output_gate=True,
    partial_rotary_factor=0.25,
    norm_unit_offset=True,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)
# The seed's target, a hybrid "Next" MoE model with hidden size 2560 and aux layers 45-47 (no public
# config): Qwen3-Next-80B-A3B's config (`transformers`' `Qwen3NextConfig` defaults, which are that model's,
# with its rope_theta 1e7, intermediate_size 5120 and 256k positions) at the seed's hidden size, 52 layers
# deep: the seed's ids are layer outputs (DeepSpec's convention), and no engine captures the last layer's
# (SGLang and vLLM capture layer k's output at the input of layer k + 1; DeepSpec's evaluator refuses it),
# so the seed's target has layers after 47; Qwen3-Next-80B's 48 would make 47 the last. Every 4th layer full
# attention (16 query / 2 KV heads x 256, sigmoid output gate, RoPE on the first quarter of each head), the
# others Gated DeltaNet (16 key / 32 value heads x 128, 4 conv taps); every MLP routes to 10 of 512 experts
# of width 512 plus a gated shared expert of 512. About 108B parameters (104.7B in the experts), 217 GB in
# bf16. The AOT checks (`check_memory`) and the draft's shape read it; a run with `target.path` reads the
# checkpoint's own config.
PAPER_TARGET = dict(
    family="qwen3_next",
    vocab_size=151936,
    hidden_size=2560,
    intermediate_size=5120,
    num_layers=52,
    num_heads=16,
    num_kv_heads=2,
    head_dim=256,
    rope_theta=10000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    qk_norm=True,
    max_position_embeddings=262144,
    eos_token_ids=(151645,),
    layer_types=("linear_attention", "linear_attention", "linear_attention", "full_attention") * 13,
    attn_output_gate=True,
    partial_rotary_factor=0.25,
    norm_unit_offset=True,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_experts=512,
    num_experts_per_tok=10,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
)
PRESETS = ("paper", "demo", "accel", "smoke")


def get_config(preset: str = "paper") -> config_dict.ConfigDict:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {PRESETS}")
    smoke = preset == "smoke"
    c = config_dict.ConfigDict()
    c.experiment = "baseline"
    c.preset = preset
    c.seed = 42

    c.target = config_dict.ConfigDict()
    c.target.path = ""
    c.target.name = {
        "paper": "Qwen3.8-Flash-Next",
        "demo": "SmolLM2-135M-Instruct",
        "accel": "SmolLM2-135M-Instruct",
        "smoke": "random",
    }[preset]
    c.target.random_init = smoke
    c.target.arch = config_dict.ConfigDict(
        {"paper": PAPER_TARGET, "demo": DEMO_TARGET, "accel": DEMO_TARGET, "smoke": SMOKE_TARGET}[preset]
    )
    c.target.param_dtype = "bfloat16" if preset == "paper" else "float32"
    c.target.dtype = "bfloat16" if preset == "paper" else "float32"

    c.mesh = config_dict.ConfigDict(dict(data=1, fsdp=-1, tensor=1))
    c.sharding = config_dict.ConfigDict()
    c.sharding.rules = sharding.DEFAULT_RULES

    c.generate = config_dict.ConfigDict()
    c.generate.batch_size = 64 if preset == "accel" else 8
    c.generate.max_new_tokens = 16 if smoke else 256
    c.generate.temperature = 0.0
    c.generate.top_p = 1.0
    c.generate.padding = "left"
    c.generate.select_top_k = 0
    c.generate.draft_len = 0
    c.generate.draft_vocab = 0

    c.data = config_dict.ConfigDict()
    c.data.cache_dir = ""
    c.data.train_cache = ""
    c.data.val_cache = ""
    # The demo trains on chat and GSM8K-style math, half each (results/demo-recipe-2026-12-04).
    c.data.train_source = "sharegpt=1,gsm8k_rest=1" if preset == "demo" else "sharegpt"
    c.data.train_limit = {"paper": 0, "demo": 800, "accel": 4000, "smoke": 6}[preset]
    c.data.val_source = ""
    c.data.val_limit = {"paper": 256, "demo": 256, "accel": 256, "smoke": 4}[preset]
    c.data.aux_layer_ids = {
        "paper": (45, 46, 47),
        "demo": (26, 27, 28),
        "accel": (26, 27, 28),
        "smoke": (1, 2, 3),
    }[preset]
    c.data.tap_last_layer = False
    c.data.max_length = {"paper": 4096, "demo": 1024, "accel": 2048, "smoke": 256}[preset]
    c.data.pack = preset in ("demo", "accel")
    c.data.num_shards = {"paper": 256, "demo": 4, "accel": 16, "smoke": 2}[preset]
    c.data.regenerate = True
    c.data.regen_max_new_tokens = {"paper": 2048, "demo": 128, "accel": 256, "smoke": 8}[preset]
    c.data.regen_max_prompt_tokens = {"paper": 2048, "demo": 256, "accel": 512, "smoke": 128}[preset]
    c.data.regen_batch_size = {"paper": 64, "demo": 32, "accel": 256, "smoke": 4}[preset]
    c.data.regen_chunk_size = {"paper": 512, "demo": 256, "accel": 1024, "smoke": 64}[preset]
    c.data.regen_max_turns = {"paper": 64, "demo": 1, "accel": 1, "smoke": 2}[preset]
    c.data.worker_count = 0
    c.data.features = "offline"
    c.data.online_dtype = "bfloat16"
    c.data.online_chunks = 1

    c.draft = config_dict.ConfigDict()
    c.draft.num_layers = 3
    # demo and accel: the target's own layer shape (9 query / 3 KV heads), so the draft starts from its layers
    c.draft.num_heads = {"paper": 24, "demo": 9, "accel": 9, "smoke": 4}[preset]
    c.draft.num_kv_heads = 3 if preset in ("demo", "accel") else 2
    c.draft.head_dim = {"paper": 256, "demo": 64, "accel": 64, "smoke": 16}[preset]
    c.draft.intermediate_size = {"paper": 9728, "demo": 1536, "accel": 1536, "smoke": 128}[preset]
    c.draft.block_size = 7
    c.draft.markov_rank = 32 if smoke else 256
    c.draft.mask_token_id = 151669 if preset == "paper" else SMOLLM2_MASK_ROW
    c.draft.param_dtype = "float32"
    c.draft.dtype = "bfloat16" if preset in ("paper", "accel") else "float32"
    c.draft.attention = "xla"
    c.draft.attention_block_q = 8
    c.draft.attention_block_k = 128
    c.draft.anchor_chunk = 16 if preset in ("paper", "accel") else 8
    c.draft.remat = preset == "paper"

    c.train = config_dict.ConfigDict()
    c.train.num_anchors = {"paper": 512, "demo": 64, "accel": 192, "smoke": 8}[preset]
    c.train.global_batch = {"paper": 512, "demo": 2, "accel": 8, "smoke": 2}[preset]
    c.train.grad_accum = {"paper": 32, "demo": 1, "accel": 1, "smoke": 1}[preset]
    c.train.total_steps = {"paper": 26040, "demo": 300, "accel": 2000, "smoke": 6}[preset]
    c.train.stop_step = {"paper": 2604, "demo": 300, "accel": 2000, "smoke": 6}[preset]
    c.train.peak_lr = {"paper": 3e-4, "demo": 3e-3, "accel": 3e-3, "smoke": 3e-4}[preset]
    c.train.warmup_fraction = 0.04
    c.train.weight_decay = 0.0
    c.train.draft_vocab = {"paper": 0, "demo": 8192, "accel": 0, "smoke": 0}[preset]
    c.train.clip_norm = 1.0
    c.train.copied_lr_scale = 1.0
    c.train.b1 = 0.9
    c.train.b2 = 0.999
    c.train.eps = 1e-8
    c.train.checkpoint_every = {"paper": 651, "demo": 150, "accel": 500, "smoke": 3}[preset]
    c.train.max_to_keep = 3
    c.train.log_every = {"paper": 10, "demo": 10, "accel": 25, "smoke": 1}[preset]
    c.train.eval_every = {"paper": 651, "demo": 150, "accel": 250, "smoke": 3}[preset]
    c.train.eval_batches = {"paper": 0, "demo": 0, "accel": 0, "smoke": 2}[preset]
    c.train.ablate_every_eval = False
    c.train.seed = config_dict.placeholder(int)

    c.init = config_dict.ConfigDict()
    # demo and accel: three copies of the target's last layer, reading the last aux layer (its input) as it
    # does; the draft then reads its context (results/demo-context-2026-12-07: removing it costs 0.56 tau_prob
    # at 150 steps, 0.03 from a random init).
    c.init.from_target_layers = config_dict.placeholder(tuple)
    c.init.context_from_aux = config_dict.placeholder(int)
    if preset in ("demo", "accel"):  # `--config.init.from_target_layers=None` (and context_from_aux): random
        c.init.from_target_layers = (-1, -1, -1)
        c.init.context_from_aux = -1
    c.lock()
    return c


def with_engram(config: config_dict.ConfigDict, experiment: str) -> config_dict.ConfigDict:
    """`config` as one of the Engram groups: the `engram` table section (keys in
    `dspark_jax/groups/engram/prepare.py`) and the draft's view of the table's shape.

    Paper: orders 2-3 x 8 heads x 160 = 2,560 features; demo and accel: x 36 = 576; smoke: x 4 = 64. The fit
    reads ShareGPT conversations past the ones training uses (the paper preset names no fit source: give
    `engram.table_path` or `engram.fit_source`).
    """
    preset = config.preset
    with config.unlocked():
        config.experiment = experiment
        e = config.engram = config_dict.ConfigDict()
        e.table_path = ""
        e.max_order = 3
        e.heads = 8
        e.head_dim = {"paper": 160, "demo": 36, "accel": 36, "smoke": 4}[preset]
        e.seed = 0
        e.layer_id = 0
        e.table_multiplier = 5
        e.fit_source = "" if preset == "paper" else "sharegpt"
        e.fit_offset = config.data.train_limit
        e.fit_limit = {"paper": 0, "demo": 600, "accel": 4000, "smoke": 4}[preset]
        e.fit_max_length = {"paper": 4096, "demo": 256, "accel": 1024, "smoke": 64}[preset]
        e.projection_seed = 0
        config.draft.engram_dim = (e.max_order - 1) * e.heads * e.head_dim
        config.draft.engram_order = e.max_order
    return config
