"""Host side of speculative decoding: batching, compilation per shape, and the MAL report."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dspark_jax.draft.model import DraftVocab, FrozenTarget, make_draft_vocab
from dspark_jax.inference import calibration, scheduler
from dspark_jax.inference.engine import DSPARK_PROPOSER, Proposer, SpecSettings, speculate_program
from dspark_jax.target.generate import GREEDY, BatchedDecoding, Generator, SamplingParams, check_prompts
from dspark_jax.target.model import Transformer


@dataclasses.dataclass
class SpecReport:
    """Acceptance and speed over all requests of a decoder.

    `mal_pooled` = accepted tokens per cycle pooled over all cycles; `mal_per_request` = mean of
    each request's own mean; `accepted_hist[n]` = cycles that emitted `n` tokens (n = accepted
    drafts + 1); `acceptance_by_position[i]` = P(proposal i accepted | proposal i verified);
    `confidence_by_position[i]` = mean predicted acceptance of the verified proposals i (calibrated when
    the decoder has STS temperatures); `mean_verified_length` = proposals verified per cycle (7 under the
    fixed schedule); `mal_per_verified_token` = tokens emitted per token the target verified (the pending
    token included); `mean_verify_width` = the padded verification width per loop iteration;
    `loop_ms_per_cycle` = wall time per decode-loop iteration (a batch's rows cycle together;
    prefill included, so it sits above the pure cycle latency of `inference.timing`). The units an
    interval resamples: `per_request` (each request's emitted tokens and cycles: MAL) and `per_batch` (each
    program call's generated tokens and seconds: tokens/s).
    """

    requests: int = 0
    generated_tokens: int = 0
    cycles: int = 0
    loop_iterations: int = 0
    seconds: float = 0.0
    compile_seconds: float = 0.0
    per_request_mal: list[float] = dataclasses.field(default_factory=list)
    per_request_tokens: list[int] = dataclasses.field(default_factory=list)
    per_request_cycles: list[int] = dataclasses.field(default_factory=list)
    per_batch_tokens: list[int] = dataclasses.field(default_factory=list)
    per_batch_seconds: list[float] = dataclasses.field(default_factory=list)
    accepted_hist: np.ndarray | None = None
    reached: np.ndarray | None = None
    accepted: np.ndarray | None = None
    confidence: np.ndarray | None = None
    accepted_tokens: int = 0
    verified: int = 0
    verify_width: int = 0

    def add(self, stats: dict[str, np.ndarray], rows: int, tokens: int, iterations: int, seconds: float):
        cycles_B, lengths_B = stats["cycles_B"][:rows], stats["accepted_len_B"][:rows]
        self.seconds += seconds
        self.per_batch_tokens.append(tokens)
        self.per_batch_seconds.append(seconds)
        self.per_request_tokens += [int(n) for n in lengths_B]
        self.per_request_cycles += [int(c) for c in cycles_B]
        self.loop_iterations += iterations
        self.accepted_tokens += int(lengths_B.sum())
        self.verified += int(stats["verified_B"][:rows].sum())
        self.verify_width += int(stats["verify_width"])
        self.requests += rows
        self.generated_tokens += tokens
        self.cycles += int(cycles_B.sum())
        self.per_request_mal += [float(n / c) for n, c in zip(lengths_B, cycles_B) if c]
        for name, key in (
            ("accepted_hist", "accepted_hist"),
            ("reached", "reached_S"),
            ("accepted", "accepted_S"),
            ("confidence", "confidence_S"),
        ):
            value = np.asarray(stats[key], np.float64)
            setattr(self, name, value if getattr(self, name) is None else getattr(self, name) + value)

    def as_dict(self) -> dict:
        hist = self.accepted_hist if self.accepted_hist is not None else np.zeros(1)
        reached = np.maximum(self.reached if self.reached is not None else np.zeros(1), 1)
        return {
            "requests": self.requests,
            "generated_tokens": self.generated_tokens,
            "cycles": self.cycles,
            "mal_pooled": float((hist * np.arange(len(hist))).sum() / max(hist.sum(), 1)),
            "mal_per_request": float(np.mean(self.per_request_mal)) if self.per_request_mal else 0.0,
            "accepted_length_histogram": {str(n): int(c) for n, c in enumerate(hist) if n},
            "acceptance_by_position": (self.accepted / reached).tolist() if self.accepted is not None else [],
            "confidence_by_position": (self.confidence / reached).tolist()
            if self.confidence is not None
            else [],
            "mean_verified_length": self.verified / max(self.cycles, 1),
            "mal_per_verified_token": self.accepted_tokens / max(self.verified + self.cycles, 1),
            "mean_verify_width": self.verify_width / max(self.loop_iterations, 1),
            "seconds": self.seconds,
            "compile_seconds": self.compile_seconds,
            "tokens_per_second": self.generated_tokens / self.seconds if self.seconds else 0.0,
            "loop_ms_per_cycle": 1e3 * self.seconds / max(self.loop_iterations, 1),
            "loop_iterations": self.loop_iterations,
            "per_request": {"tokens": self.per_request_tokens, "cycles": self.per_request_cycles},
            "per_batch": {"tokens": self.per_batch_tokens, "seconds": self.per_batch_seconds},
        }


SCHEDULES = ("fixed", "confidence")


class SpeculativeDecoder(BatchedDecoding):
    """Speculative decoding of token prompts with a target and a trained draft.

    Args:
      target: the target model. draft_graphdef/params/rest: the draft split by `nnx.split`.
      frozen: the target's embedding and LM head as the draft reads them.
      proposer: how the draft's experiment group makes a block (`groups.get(name).model.proposer`).
      aux_layer_ids: the target layers the draft was trained on.
      batch_size: concurrent requests per compiled program.
      select_top_k: draft tokens are chosen among each slot's K best base logits (0 = all; see
        `engine.markov_select`).
      schedule: 'fixed' verifies every proposal; 'confidence' lets the prefix scheduler choose per row
        and cycle (`inference.scheduler`), from the confidence head calibrated by `temperatures`.
      temperatures: STS temperatures per calibration mode (`calibration.MODES`), e.g. from
        `calibration.load_temperatures`; None = the raw head (T = 1).
      verify_buckets: the scheduler's verification widths (`scheduler.check_buckets`, up to
        `draft_len + 1`); None = `scheduler.default_buckets`.
      draft_len: proposals drafted and verified at most per cycle, the block's first slots (0 = all of
        them, `block_size`).
      draft_vocab: the token ids the draft may propose (e.g. `vocabulary.most_frequent` of the training
        text); each selection then reads only their columns of the LM head. None = the whole vocabulary.
        Lossless either way: the target decides what is emitted.
    """

    def __init__(
        self,
        target: Transformer,
        draft_graphdef: nnx.GraphDef,
        draft_params: nnx.State,
        draft_rest: nnx.State,
        frozen: FrozenTarget,
        *,
        proposer: Proposer = DSPARK_PROPOSER,
        aux_layer_ids: Sequence[int],
        eos_ids: Sequence[int],
        pad_id: int,
        batch_size: int = 1,
        mesh: Mesh | None = None,
        select_top_k: int = 0,
        schedule: str = "fixed",
        temperatures: dict[str, tuple[float, ...]] | None = None,
        verify_buckets: Sequence[int] | None = None,
        draft_len: int = 0,
        draft_vocab: Sequence[int] | np.ndarray | None = None,
    ):
        super().__init__(pad_id=pad_id, batch_size=batch_size, padding="right", mesh=mesh)
        if select_top_k < 0:
            raise ValueError(f"select_top_k must be >= 0 (0 = the whole vocabulary), got {select_top_k}")
        draft_cfg = nnx.merge(draft_graphdef, draft_params, draft_rest).cfg
        t = target.cfg
        for name, d, v in (
            ("hidden_size", draft_cfg.hidden_size, t.hidden_size),
            ("vocab_size", draft_cfg.vocab_size, t.vocab_size),
            ("number of aux layers", draft_cfg.num_aux, len(aux_layer_ids)),
        ):
            if d != v:
                raise ValueError(f"draft and target disagree on {name}: draft {d}, target {v}")
        if not eos_ids:
            raise ValueError("at least one EOS id is needed to stop decoding")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if not 0 <= draft_len <= draft_cfg.block_size:
            raise ValueError(
                f"draft_len must be in 0..{draft_cfg.block_size} (0 = the whole block), got {draft_len}"
            )
        for mode, values in (temperatures or {}).items():
            if mode not in calibration.MODES or len(values) != draft_cfg.block_size:
                raise ValueError(
                    f"temperatures[{mode!r}]: the mode must be one of {calibration.MODES} and the values "
                    f"{draft_cfg.block_size}, one per proposal"
                )
        self.target_graphdef, self.target_state = nnx.split(target)
        self.draft = (draft_graphdef, draft_params, draft_rest)
        self.proposer = proposer
        self.block_size = draft_cfg.block_size
        self.frozen = (
            frozen if draft_vocab is None else frozen._replace(draft_vocab=self._vocab(frozen, draft_vocab))
        )
        self.cfg = t
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.eos_ids = tuple(int(e) for e in eos_ids)
        self.select_top_k = select_top_k
        self.schedule = schedule
        self.temperatures = dict(temperatures or {})
        self.draft_len = draft_len or self.block_size
        self.verify_buckets = scheduler.check_buckets(
            scheduler.default_buckets(self.draft_len) if verify_buckets is None else verify_buckets,
            self.draft_len,
        )
        self.sps_table: scheduler.SpsTable | None = None  # profiled on the first confidence-scheduled batch
        self._sps_N = None  # (table, its dense device array)
        self.report = SpecReport()

    @property
    def draft_vocab_size(self) -> int:
        """Tokens the draft may propose; 0 = the whole vocabulary."""
        vocab = self.frozen.draft_vocab
        return 0 if vocab is None else vocab.ids_K.shape[0]

    def _vocab(self, frozen: FrozenTarget, ids: Sequence[int] | np.ndarray) -> DraftVocab:
        """The draft vocabulary of token `ids` on this decoder's mesh (replicated), checked."""
        ids_K = np.asarray(ids)
        vocab = frozen.lm_head_HxV.shape[1]
        if ids_K.ndim != 1 or not len(ids_K) or not np.issubdtype(ids_K.dtype, np.integer):
            raise ValueError(f"draft_vocab must be a non-empty list of token ids, got shape {ids_K.shape}")
        if ids_K.min() < 0 or ids_K.max() >= vocab or len(np.unique(ids_K)) != len(ids_K):
            raise ValueError(f"draft_vocab must hold distinct token ids in 0..{vocab - 1}")
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return make_draft_vocab(frozen.lm_head_HxV, ids_K, replicated, replicated)

    def target_only(self) -> Generator:
        """Target-only decoding with this decoder's target, batching and mesh: the speed baseline, and
        the output greedy speculation must equal."""
        return Generator(
            nnx.merge(self.target_graphdef, self.target_state),
            eos_ids=self.eos_ids,
            pad_id=self.pad_id,
            batch_size=self.batch_size,
            padding="right",
            mesh=self.mesh,
        )

    def max_len(self, prompt_len: int, max_new_tokens: int) -> int:
        """Cache slots of a program: prompt, new tokens and room for one block past the end."""
        return prompt_len + max_new_tokens + 2 * (self.block_size + 1)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        params: SamplingParams = GREEDY,
        seed: int = 0,
    ) -> list[list[int]]:
        """Generated ids per prompt (EOS excluded); acceptance statistics accumulate in `report`."""
        check_prompts(
            prompts, max_new_tokens, self.cfg.max_position_embeddings, reserved=2 * (self.block_size + 1)
        )
        results = []
        settings = self.settings(max_new_tokens, params)
        for batch in self.batches(prompts):
            max_len = self.max_len(batch.length, max_new_tokens)
            fn = functools.partial(
                speculate_program,
                target_graphdef=self.target_graphdef,
                draft_graphdef=self.draft[0],
                max_len=max_len,
                settings=settings,
                proposer=self.proposer,
            )
            rng = jax.random.fold_in(jax.random.key(seed), batch.start)
            args = (self.target_state, *self.draft[1:], self.frozen, batch.tokens_BxP, batch.lengths_B)
            args = (*args, batch.real_B, rng, self.sps(max_len) if settings.verify_buckets else None)
            program = self.compiled((batch.length, max_new_tokens, params), fn, *args)
            begin = time.perf_counter()
            state = jax.device_get(program(*args))
            seconds = time.perf_counter() - begin
            out, counts = np.asarray(state.out_BxO), np.asarray(state.count_B)
            new = []
            for row in range(batch.rows):
                ids = out[row, : counts[row]].tolist()
                new.append(ids[: next((i for i, t in enumerate(ids) if t in self.eos_ids), len(ids))])
            results += new
            self.report.add(
                {k: np.asarray(v) for k, v in state.stats.items()},
                batch.rows,
                sum(len(r) for r in new),
                int(state.cycle),
                seconds,
            )
        self.report.compile_seconds = self.compile_seconds
        return results

    def settings(self, max_new_tokens: int, params: SamplingParams) -> SpecSettings:
        """The static settings of this decoder's programs for one sampling setting."""
        return SpecSettings(
            max_new_tokens,
            params,
            self.eos_ids,
            self.aux_layer_ids,
            self.select_top_k,
            self.temperatures.get(calibration.mode_of(params.temperature)),
            self.verify_buckets if self.schedule == "confidence" else None,
            self.draft_len,
        )

    def sps(self, max_len: int) -> jax.Array:
        """The scheduler's throughput table `SPS(n)`, profiled on the first call at `max_len` cache slots."""
        if self.sps_table is None:
            self.sps_table = scheduler.profile_sps(
                nnx.merge(self.target_graphdef, self.target_state),
                rows=self.batch_size,
                max_len=max_len,
                buckets=self.verify_buckets,
                aux_layer_ids=self.aux_layer_ids,
            )
        if self._sps_N is None or self._sps_N[0] is not self.sps_table:  # placed once per table
            dense = self.sps_table.dense(self.batch_size * (self.block_size + 1))
            self._sps_N = (self.sps_table, jax.device_put(dense, NamedSharding(self.mesh, PartitionSpec())))
        return self._sps_N[1]
