"""Measurements of a trained checkpoint at inference: STS calibration of its confidence head and speculative
decoding with real target verification against target-only decoding.

The library side of `python -m dspark_jax.calibrate` and `python -m dspark_jax.speculate`, also called in
process by the experiment suite (`dspark_jax.suite`), which loads the target once for every group and
decodes target-only once per setting.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from dspark_jax import groups
from dspark_jax.inference import calibration, scheduler
from dspark_jax.inference.decoder import SpeculativeDecoder
from dspark_jax.inference.timing import time_cycle_phases
from dspark_jax.interop.consumers import side_files
from dspark_jax.run import checkpoints, config_lib, decoding, draft_state, target_side
from dspark_jax.suite import plots
from dspark_jax.target import Target
from dspark_jax.target.generate import SamplingParams, generate_replies
from dspark_jax.training.evaluation import block_records, open_validation

_ACCEPTANCE = {"greedy": "greedy_accept", "sampling": "overlap"}


def _blocks(records: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """`[blocks, S]` arrays of the valid blocks (first position present) of some micro-batches."""
    joined = {k: np.concatenate([r[k].reshape(-1, r[k].shape[-1]) for r in records]) for k in records[0]}
    valid = joined["eval_mask"][:, 0] > 0
    return {k: x[valid] for k, x in joined.items()}


def fit_and_report(records: list[dict[str, np.ndarray]], bins: int) -> dict:
    """STS for each mode on the even micro-batches; ECE and reliability tables on both halves."""
    halves = {"fit": _blocks(records[0::2]), "held_out": _blocks(records[1::2] or records[0::2])}
    result = {"temperatures": {}, "ece": {}, "reliability": {}}
    for mode, key in _ACCEPTANCE.items():
        fit_set = halves["fit"]
        fit = calibration.fit_sts(fit_set["confidence_logit"], fit_set[key], fit_set["eval_mask"], bins=bins)
        result["temperatures"][mode] = list(fit.temperatures)
        result["ece"][mode], result["reliability"][mode] = {}, {}
        for half, blocks in halves.items():
            logits, accept, mask = blocks["confidence_logit"], blocks[key], blocks["eval_mask"] > 0
            raw = np.ones_like(fit.temperatures)
            result["ece"][mode][half] = {
                "before": calibration.position_ece(logits, accept, mask, raw, bins),
                "after": calibration.position_ece(logits, accept, mask, fit.temperatures, bins),
            }
            measured = np.cumprod(accept, axis=1)
            result["reliability"][mode][half] = {
                name: [
                    calibration.reliability(pred[mask[:, k], k], measured[mask[:, k], k], bins)
                    for k in range(mask.shape[1])
                ]
                for name, pred in (
                    ("before", calibration.survival(logits, raw)),
                    ("after", calibration.survival(logits, fit.temperatures)),
                )
            }
    result["blocks"] = {half: len(b["eval_mask"]) for half, b in halves.items()}
    return result


def calibrate_checkpoint(config, checkpoint: str | os.PathLike, bins: int = calibration.DEFAULT_BINS):
    """Fits STS on the checkpoint's validation cache and writes `<workdir>/calibration/step_<N>/sts.json`
    plus one reliability PNG per mode beside it. Returns `(path, record)`."""
    validation = open_validation(config, checkpoint)
    result = fit_and_report(block_records(validation), bins)
    path = checkpoints.calibration_file(checkpoint, validation.step)
    record = {"step": validation.step, "experiment": config.experiment, "bins": bins, **result}
    calibration.save(path, record)
    for mode in calibration.MODES:
        plots.reliability_diagrams(
            path.parent / f"reliability_{mode}.png",
            result["reliability"][mode]["held_out"],
            f"{config.experiment} step {validation.step}: {mode} acceptance, held-out blocks",
        )
    return path, record


def profile_serving_sps(
    config, checkpoint: str | os.PathLike, rows: Sequence[int], cache_slots: int, mesh: Mesh, repeats: int = 5
):
    """Profiles the target's verification forward (`scheduler.profile_sps`) at every `rows` count and width
    `1..S+1` on this device and writes SGLang's SPS cost table (batch tokens -> passes per second, with the
    device named) to `checkpoints.sps_table_file(checkpoint)`. Returns `(path, table)`."""
    target = target_side.load_run_target(config, mesh)
    widths = range(1, config.draft.block_size + 2)
    tables = [
        scheduler.profile_sps(
            target.model,
            rows=b,
            max_len=cache_slots,
            buckets=widths,
            aux_layer_ids=config.data.aux_layer_ids,
            repeats=repeats,
        )
        for b in rows
    ]
    device = jax.devices()[0]
    table = side_files.sps_file(
        [n for t in tables for n in t.tokens],
        [v for t in tables for v in t.sps],
        max(rows) * (config.draft.block_size + 1),
        device=f"{len(jax.devices())} x {device.device_kind} ({device.platform})",
        target=config.target.name,
        rows=list(rows),
        cache_slots=cache_slots,
        jax_version=jax.__version__,
    )
    path = checkpoints.sps_table_file(checkpoint)
    calibration.save(path, table)
    return path, table


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """One decoding setting, shared by the speculative run and its target-only baseline.

    `select_top_k` / `draft_len` / `draft_vocab` None = the config's `generate` values; `schedule` 'fixed' or
    'confidence' (the latter needs the checkpoint's STS calibration).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 96
    concurrency: int = 1
    select_top_k: int | None = None
    schedule: str = "fixed"
    draft_len: int | None = None
    draft_vocab: int | None = None

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p)

    @property
    def target_only_key(self) -> tuple:
        """What target-only decoding depends on (not the draft, its selection or its schedule)."""
        return (self.temperature, self.top_p, self.seed, self.max_new_tokens, self.concurrency)


def _replies(decoder, target: Target, conversations, s: DecodeSettings):
    kw = dict(max_new_tokens=s.max_new_tokens, params=s.sampling, seed=s.seed)
    return generate_replies(decoder, target.tokenizer, target.chat_template, conversations, **kw)


def target_only(decoder: SpeculativeDecoder, target: Target, conversations, s: DecodeSettings) -> dict:
    """Target-only decoding of `conversations` with the decoder's target and batching: `stats` (tokens/s)
    and the reply ids greedy speculation must equal."""
    baseline = decoder.target_only()
    plain = _replies(baseline, target, conversations, s)
    return {"stats": baseline.stats.as_dict(), "reply_ids": [ids for _, ids in plain]}


def speculative_decoder(config, checkpoint, target: Target, mesh: Mesh, s: DecodeSettings):
    """`(decoder, checkpoint step)` for one setting; a confidence schedule reads the calibration first."""
    temperatures = None
    if s.schedule == "confidence":
        step = checkpoints.checkpoint_step(checkpoint)
        temperatures = checkpoints.load_calibration(checkpoint, step, config.draft.block_size)
    graphdef, params, rest, step = draft_state.restore_draft(config, target.config, mesh, checkpoint)
    decoder = decoding.speculative_decoder(
        config,
        target,
        (graphdef, params, rest),
        batch_size=s.concurrency,
        mesh=mesh,
        select_top_k=s.select_top_k,
        draft_len=s.draft_len,
        draft_vocab=s.draft_vocab,
        schedule=s.schedule,
        temperatures=temperatures,
    )
    return decoder, step


def speculate(
    decoder: SpeculativeDecoder,
    step: int,
    config,
    target: Target,
    conversations: Sequence[Sequence[str]],
    s: DecodeSettings,
    *,
    input_name: str,
    baseline: dict | None = None,
    time_phases: bool = True,
) -> dict:
    """Speculative decoding of `conversations` next to target-only decoding under the same setting
    (`baseline`, from `target_only`, or decoded here): MAL, cycle phases, tokens/s, speedup, greedy
    equality, and `requests` (each conversation's replies and reply ids). `time_phases=False` skips the
    cycle's latency split (`cycle_phases_ms` None), which compiles each phase apart."""
    spec = _replies(decoder, target, conversations, s)
    baseline = baseline or target_only(decoder, target, conversations, s)
    report = decoder.report.as_dict()
    # The phases are timed on the target's first replies as token prompts (any real text will do).
    token_prompts = [ids[0] for ids in baseline["reply_ids"] if ids and ids[0]] or [[0]]
    result = {
        "checkpoint_step": step,
        "settings": {
            "experiment": config.experiment,
            **dataclasses.asdict(s),
            "select_top_k": decoder.select_top_k,
            "proposals_per_cycle": decoder.draft_len,
            "draft_vocab_size": decoder.draft_vocab_size,
            **{
                option.flag: config_lib.get_key(config, option.key)
                for option in groups.get(config.experiment).run.decode_options
            },
            "confidence_temperatures": decoder.settings(s.max_new_tokens, s.sampling).confidence_temperatures,
            "conversations": len(conversations),
            "input": input_name,
        },
        "speculative": report,
        "cycle_phases_ms": time_cycle_phases(decoder, token_prompts, max_new_tokens=32, params=s.sampling)
        if time_phases
        else None,
        "sps_table": decoder.sps_table.as_dict() if decoder.sps_table else None,
        "target_only": baseline["stats"],
        "speedup": report["tokens_per_second"] / max(baseline["stats"]["tokens_per_second"], 1e-9),
    }
    if s.temperature == 0:
        same = sum(ids == plain for (_, ids), plain in zip(spec, baseline["reply_ids"]))
        result["identical_to_target_greedy"] = f"{same}/{len(spec)}"
    result["requests"] = [{"replies": replies, "reply_ids": ids} for replies, ids in spec]
    return result
