"""Speculative decoding with a trained draft and real target verification: MAL, latency, tokens/s.

  python -m dspark_jax.speculate --checkpoint=DIR [--config=configs/baseline.py[:preset]] \
      [--input=IN.jsonl] [--output=OUT.json] [--temperature=T] [--top_p=P] [--concurrency=C] \
      [--max_new_tokens=N] [--limit=N] [--seed=S] [--select_top_k=K] [--offline] \
      [--schedule=fixed|confidence] [--draft_len=L] [--draft_vocab=N] [--<a group's own flag>=VALUE]

`--checkpoint` takes a training work directory (its latest checkpoint) or one checkpoint's
directory; the run's stored config is used unless `--config` is given (it must agree with the
stored one on every key that shapes the draft). Sampling and the reply cap default to the config's
`generate` section (greedy). The input defaults to the packaged GSM8K-256 prompts. The same prompts are also
decoded by the target alone (same sampling, concurrency and max length) for the speedup,
and at temperature 0 the two outputs are compared token for token. `--offline` adds the
teacher-forced metrics (tau_prob, accept_rate_i) of the same checkpoint on the validation
cache, which holds the target's replies to the GSM8K-256 prompts. A group may add flags of its own
(`Experiment.run.decode_options`, listed by `--help`; e.g. Draft Memory's next-round memory source), which
only its checkpoints take.
`--schedule=confidence` lets the hardware-aware prefix scheduler choose how many proposals each request
verifies per cycle, from the confidence head calibrated by `python -m dspark_jax.calibrate` (required
first) and a verification throughput table profiled at start (reported as `sps_table`); `fixed`
verifies all of them. `--draft_len=L` drafts only the block's first `L` proposals per cycle (a shorter
verification forward, for hardware where its cost grows fast with its width). `--draft_vocab=N` lets the
draft propose only the `N` tokens the run's training responses use most (its cache must be there): each
selection reads `N` columns of the LM head instead of all of them.
"""

from __future__ import annotations

import json

from absl import flags
from etils import epath

from dspark_jax import groups, sharding
from dspark_jax.cli import (
    SamplingFlags,
    check_flags,
    checkpoint_config,
    define_config_flag,
    define_path_flag,
    run,
)
from dspark_jax.data.conversations import GSM8K_VAL256, read_turns_jsonl
from dspark_jax.inference.decoder import SCHEDULES
from dspark_jax.run import checkpoints, config_lib
from dspark_jax.suite import measure
from dspark_jax.target import target_from_config
from dspark_jax.training.evaluation import evaluate_checkpoint

_CONFIG = define_config_flag(default=None)
_CHECKPOINT = define_path_flag("checkpoint", None, "Training work directory or checkpoint.", required=True)
_INPUT = define_path_flag("input", str(GSM8K_VAL256), "JSONL of {'turns': [...]} prompts.")
_OUTPUT = define_path_flag("output", None, "Output JSON (report + per-request replies).")
_CONCURRENCY = flags.DEFINE_integer("concurrency", 1, "Requests decoded together.")
_LIMIT = flags.DEFINE_integer("limit", 0, "Use only the first N conversations (0 = all).")
_SAMPLING = SamplingFlags()
_OFFLINE = flags.DEFINE_bool("offline", False, "Also report offline tau_prob on the validation cache.")
_GROUP_OPTIONS = {
    flag: (option, owners, flags.DEFINE_enum(flag, None, list(option.choices), option.help))
    for flag, (option, owners) in groups.decode_options().items()
}
_SCHEDULE = flags.DEFINE_enum(
    "schedule",
    "fixed",
    list(SCHEDULES),
    "Proposals verified per cycle: all, or the confidence scheduler's choice.",
)
_SELECT_TOP_K = flags.DEFINE_integer(
    "select_top_k",
    None,
    "Draft tokens chosen among each slot's K best base logits (0 = all); default: config.",
)
_DRAFT_LEN = flags.DEFINE_integer(
    "draft_len", None, "Proposals drafted per cycle, the block's first L (0 = all); default: config."
)
_DRAFT_VOCAB = flags.DEFINE_integer(
    "draft_vocab",
    None,
    "Tokens the draft may propose: the N its training responses use most (0 = all); default: the run's "
    "generate.draft_vocab, else the vocabulary it trained on (train.draft_vocab).",
)


def main(argv):
    del argv
    _SAMPLING.check()
    check_flags(
        concurrency=(_CONCURRENCY.value >= 1, f"must be >= 1, got {_CONCURRENCY.value}"),
        limit=(_LIMIT.value >= 0, f"must be >= 0 (0 = all), got {_LIMIT.value}"),
        input=(epath.Path(_INPUT.value).exists(), f"{_INPUT.value} does not exist"),
        select_top_k=(
            _SELECT_TOP_K.value is None or _SELECT_TOP_K.value >= 0,
            f"must be >= 0 (0 = the whole vocabulary), got {_SELECT_TOP_K.value}",
        ),
        draft_vocab=(
            _DRAFT_VOCAB.value is None or _DRAFT_VOCAB.value >= 0,
            f"must be >= 0 (0 = the whole vocabulary), got {_DRAFT_VOCAB.value}",
        ),
    )
    config = checkpoint_config(_CONFIG, _CHECKPOINT.value)
    block = config.draft.block_size
    check_flags(
        draft_len=(
            _DRAFT_LEN.value is None or 0 <= _DRAFT_LEN.value <= block,
            f"must be in 0..{block} (the draft's block_size; 0 = all), got {_DRAFT_LEN.value}",
        )
    )
    for flag, (option, owners, value) in _GROUP_OPTIONS.items():
        if value.value is None:
            continue
        check_flags(
            **{
                flag: (
                    config.experiment in owners,
                    f"applies to checkpoints of {', '.join(owners)}; this one is experiment "
                    f"{config.experiment!r}",
                )
            }
        )
        config_lib.set_key(config, option.key, value.value)
    sampling, seed, max_new = _SAMPLING.resolve(config)
    settings = measure.DecodeSettings(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=seed,
        max_new_tokens=max_new,
        concurrency=_CONCURRENCY.value,
        select_top_k=_SELECT_TOP_K.value,
        schedule=_SCHEDULE.value,
        draft_len=_DRAFT_LEN.value,
        draft_vocab=_DRAFT_VOCAB.value,
    )
    mesh = sharding.make_mesh(config.mesh.to_dict())
    if settings.schedule == "confidence":  # before the target loads: a missing calibration fails fast
        checkpoints.load_calibration(
            _CHECKPOINT.value, checkpoints.checkpoint_step(_CHECKPOINT.value), config.draft.block_size
        )
    target = target_from_config(config.target, seed=config.seed, mesh=mesh)
    decoder, step = measure.speculative_decoder(config, _CHECKPOINT.value, target, mesh, settings)
    conversations = read_turns_jsonl(_INPUT.value)[: _LIMIT.value or None]
    result = measure.speculate(
        decoder, step, config, target, conversations, settings, input_name=_INPUT.value
    )
    if _OFFLINE.value:
        result["offline"] = evaluate_checkpoint(config, _CHECKPOINT.value)
    print(json.dumps({k: v for k, v in result.items() if k != "requests"}, indent=2))
    if _OUTPUT.value:
        epath.Path(_OUTPUT.value).write_text(json.dumps(result, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    run(main, config_default=None)
