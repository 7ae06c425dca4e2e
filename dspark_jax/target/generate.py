"""Batched generation with a KV cache under `jax.jit`: a prefill program, then a `while_loop` decode
program called a few steps at a time (progress between calls; a batch stops as soon as its real rows
are done).

Shapes are fixed per call: prompts are padded to a length bucket (powers of two) and the
batch to `batch_size`, so a run compiles a handful of programs and then only executes.
Prompts are batched shortest first, so each batch's bucket fits its own prompts.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dspark_jax import sharding
from dspark_jax.target.chat import ChatTemplate, prompt_ids
from dspark_jax.target.model import DecodeCache, Transformer
from dspark_jax.target.tokenizer import Tokenizer

MIN_PROMPT_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Greedy when `temperature == 0`; otherwise temperature scaling then nucleus (top-p)."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


GREEDY = SamplingParams()


def sampling_logits(logits_BxV: jax.Array, params: SamplingParams) -> jax.Array:
    """Logits of the distribution actually sampled from: tempered, with the top-p tail at -inf."""
    logits_BxV = logits_BxV.astype(jnp.float32) / params.temperature
    if params.top_p < 1.0:
        sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
        probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
        before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV  # mass strictly above each token
        kept = before_BxV < params.top_p
        threshold_B = jnp.min(jnp.where(kept, sorted_BxV, jnp.inf), axis=-1)
        logits_BxV = jnp.where(logits_BxV >= threshold_B[:, None], logits_BxV, -jnp.inf)
    return logits_BxV


def sample(logits_BxV: jax.Array, rng: jax.Array, params: SamplingParams) -> jax.Array:
    """One token per row: argmax when greedy, else a draw from `sampling_logits`."""
    if params.temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(rng, sampling_logits(logits_BxV, params), axis=-1).astype(jnp.int32)


def check_prompts(
    prompts: Sequence[Sequence[int]], max_new_tokens: int, max_positions: int, reserved: int = 0
) -> None:
    """Rejects empty prompts and prompts that leave no room for `max_new_tokens` (+ `reserved`)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    limit = max_positions - max_new_tokens - reserved
    for index, prompt in enumerate(prompts):
        if not len(prompt):
            raise ValueError(f"prompt {index} is empty")
        if len(prompt) > limit:
            raise ValueError(
                f"prompt {index} has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} the "
                f"limit is {limit} (the target's max_position_embeddings={max_positions})"
            )


def prompt_bucket(length: int) -> int:
    """Smallest power of two >= `length` (at least MIN_PROMPT_BUCKET)."""
    return max(MIN_PROMPT_BUCKET, 1 << max(0, length - 1).bit_length())


def pad_prompts(prompts: Sequence[Sequence[int]], batch: int, length: int, pad_id: int, padding: str):
    """Packs prompts into `tokens [batch, length]` (left- or right-aligned) and `lengths [batch]`.

    Rows beyond `len(prompts)` are dummies of one pad token.
    """
    tokens = np.full((batch, length), pad_id, np.int32)
    lengths = np.ones((batch,), np.int32)
    for row, prompt in enumerate(prompts):
        n = len(prompt)
        if padding == "left":
            tokens[row, length - n :] = prompt
        else:
            tokens[row, :n] = prompt
        lengths[row] = n
    return tokens, lengths


@dataclasses.dataclass
class GenerationStats:
    """Totals over a Generator's calls; `seconds` is prefill + decode wall time, compiles excluded; and per
    program batch its generated tokens and seconds (the units a tokens/s interval resamples)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    compile_seconds: float = 0.0
    per_batch_tokens: list[int] = dataclasses.field(default_factory=list)
    per_batch_seconds: list[float] = dataclasses.field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "tokens_per_second": self.tokens_per_second}


class Decoding(NamedTuple):
    """Decode loop state of one batch: `B` rows, `O = max_new_tokens` output slots."""

    step: jax.Array  # tokens decoded so far (per batch, all rows together)
    cache: DecodeCache
    hidden_BxH: jax.Array  # final state of each row's last token
    done_B: jax.Array
    out_BxO: jax.Array  # generated ids; EOS included, then -1


def _prefill_program(
    state: nnx.State,
    tokens_BxP: jax.Array,
    lengths_B: jax.Array,
    *,
    graphdef: nnx.GraphDef,
    max_new_tokens: int,
    padding: str,
) -> Decoding:
    """The prompt forward: the first decode state (a cache sized for prompt plus `max_new_tokens`)."""
    model = nnx.merge(graphdef, state)
    b, p = tokens_BxP.shape
    cache = DecodeCache.zeros(model.cfg, b, p + max_new_tokens, model.dtype)
    if padding == "left":
        cache = cache._replace(start_B=(p - lengths_B).astype(jnp.int32))
    slots_P = jnp.arange(p)
    valid_BxP = (slots_P >= cache.start_B[:, None]) & (slots_P < (cache.start_B + lengths_B)[:, None])
    out = model(tokens_BxP, cache=cache, valid_BxT=valid_BxP)
    last_B = lengths_B - 1 if padding == "right" else jnp.full((b,), p - 1, jnp.int32)
    cache = out.cache._replace(end_B=out.cache.start_B + lengths_B)
    return Decoding(
        jnp.int32(0),
        cache,
        out.hidden_BxTxH[jnp.arange(b), last_B],
        jnp.zeros((b,), bool),
        jnp.full((b, max_new_tokens), -1, jnp.int32),
    )


def _decode_program(
    state: nnx.State,
    decoding: Decoding,
    rng: jax.Array,
    *,
    graphdef: nnx.GraphDef,
    steps: int,
    params: SamplingParams,
    eos_ids: tuple[int, ...],
) -> Decoding:
    """Up to `steps` more decode steps, fewer when every row hit EOS or the output is full."""
    model = nnx.merge(graphdef, state)
    eos = jnp.asarray(eos_ids, jnp.int32)
    max_new_tokens = decoding.out_BxO.shape[1]
    stop = jnp.minimum(decoding.step + steps, max_new_tokens)

    def step(d: Decoding) -> Decoding:
        token_B = sample(model.logits(d.hidden_BxH), jax.random.fold_in(rng, d.step), params)
        token_B = jnp.where(d.done_B, -1, token_B)
        nxt = model(jnp.maximum(token_B, 0)[:, None], cache=d.cache)
        return Decoding(
            d.step + 1,
            nxt.cache,
            nxt.hidden_BxTxH[:, 0],
            d.done_B | jnp.isin(token_B, eos),
            d.out_BxO.at[:, d.step].set(token_B),
        )

    return jax.lax.while_loop(lambda d: (d.step < stop) & ~jnp.all(d.done_B), step, decoding)


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """One padded batch of prompts: rows `start .. start + rows - 1` of the request list."""

    start: int
    rows: int  # real prompts; the rest of the batch is padding
    length: int  # the prompt bucket
    tokens_BxP: jax.Array  # sharded over the mesh's batch axes
    lengths_B: jax.Array
    real_B: jax.Array  # True on the real rows
    prompt_tokens: int


class BatchedDecoding:
    """What batched decoders share: requests cut into padded batches of `batch_size` rows, one
    compiled program per prompt bucket and setting (compile time kept apart from decode time)."""

    def __init__(
        self,
        *,
        pad_id: int,
        batch_size: int,
        padding: str,
        mesh: Mesh | None,
        rules: sharding.Rules = sharding.DEFAULT_RULES,
    ):
        if padding not in ("left", "right"):
            raise ValueError(f"padding must be 'left' or 'right', got {padding!r}")
        self.pad_id = pad_id
        self.batch_size = batch_size
        self.padding = padding
        self.mesh = mesh or sharding.make_mesh()
        self.rules = rules
        self.compile_seconds = 0.0
        self._compiled: dict[tuple, object] = {}

    def compiled(self, key: tuple, fn: Callable, *args, out_shardings=None):
        """The compiled program for `key`: `fn` jitted and compiled for `args` on first use.

        `out_shardings` pins the outputs' shardings (a program fed its own output needs them equal to
        its inputs')."""
        if key not in self._compiled:
            begin = time.perf_counter()
            jitted = jax.jit(fn) if out_shardings is None else jax.jit(fn, out_shardings=out_shardings)
            with sharding.tracing(self.mesh, self.rules):
                self._compiled[key] = jitted.lower(*args).compile()
            self.compile_seconds += time.perf_counter() - begin
        return self._compiled[key]

    def batches(self, prompts: Sequence[Sequence[int]]) -> Iterator[PromptBatch]:
        """The prompts as padded, sharded batches, in order."""
        for start in range(0, len(prompts), self.batch_size):
            chunk = prompts[start : start + self.batch_size]
            length = prompt_bucket(max(len(p) for p in chunk))
            tokens, lengths = pad_prompts(chunk, self.batch_size, length, self.pad_id, self.padding)
            yield PromptBatch(
                start,
                len(chunk),
                length,
                sharding.shard_batch(tokens, self.mesh, self.rules),
                sharding.shard_batch(lengths, self.mesh, self.rules),
                sharding.shard_batch(np.arange(self.batch_size) < len(chunk), self.mesh, self.rules),
                int(lengths[: len(chunk)].sum()),
            )


class Generator(BatchedDecoding):
    """Generates continuations of token prompts with a target model.

    Args:
      model: the target.
      eos_ids: tokens that end a row.
      pad_id: token used for padding (never attended to).
      batch_size: rows per compiled program; requests are split and the last batch padded.
      padding: 'left' (default) or 'right' alignment of prompts in the padded batch.
      mesh: the device mesh; the batch is sharded over its data axes.
      rules: the sharding rules the target was placed by (`sharding.tracing`).
      sort_by_length: batch the prompts in order of length (results keep the request order), so a
        batch's prompt bucket is close to its prompts' lengths instead of its longest random member.
      decode_steps: decode steps per program call; the host reports progress between calls.
    """

    def __init__(
        self,
        model: Transformer,
        *,
        eos_ids: Sequence[int],
        pad_id: int,
        batch_size: int = 8,
        padding: str = "left",
        mesh: Mesh | None = None,
        rules: sharding.Rules = sharding.DEFAULT_RULES,
        sort_by_length: bool = True,
        decode_steps: int = 16,
    ):
        super().__init__(pad_id=pad_id, batch_size=batch_size, padding=padding, mesh=mesh, rules=rules)
        if not eos_ids:
            raise ValueError("at least one EOS id is needed to stop generation")
        if decode_steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
        self.graphdef, self.state = nnx.split(model)
        self.cfg = model.cfg
        self.eos_ids = tuple(int(t) for t in eos_ids)
        self.sort_by_length = sort_by_length
        self.decode_steps = decode_steps
        self.stats = GenerationStats()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        params: SamplingParams = GREEDY,
        seed: int = 0,
        on_progress: Callable[[float, int], None] | None = None,
    ) -> list[list[int]]:
        """Generated ids per prompt, EOS excluded. Deterministic for a given seed and batching.

        `on_progress(prompts_done, tokens)` is called after every program call with the prompts done
        so far (a float: the running batch counts in proportion to its decode steps) and the tokens
        generated since the previous call.
        """
        check_prompts(prompts, max_new_tokens, self.cfg.max_position_embeddings)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i])) if self.sort_by_length else None
        batched = prompts if order is None else [prompts[i] for i in order]
        results: list[list[int]] = []
        rng = jax.random.key(seed)
        prefill = functools.partial(
            _prefill_program, graphdef=self.graphdef, max_new_tokens=max_new_tokens, padding=self.padding
        )
        decode = functools.partial(
            _decode_program,
            graphdef=self.graphdef,
            steps=self.decode_steps,
            params=params,
            eos_ids=self.eos_ids,
        )
        for batch in self.batches(batched):
            key = (batch.length, max_new_tokens)
            batch_rng = jax.random.fold_in(rng, batch.start)
            prefill_args = (self.state, batch.tokens_BxP, batch.lengths_B)
            prefill_program = self.compiled(("prefill", *key), prefill, *prefill_args)
            begin, compiling = time.perf_counter(), self.compile_seconds
            decoding = prefill_program(*prefill_args)
            decode_program = self.compiled(
                ("decode", *key, params),
                decode,
                self.state,
                decoding,
                batch_rng,
                out_shardings=jax.tree.map(lambda x: x.sharding, decoding),
            )
            tokens = 0
            while True:
                decoding = decode_program(self.state, decoding, batch_rng)
                step, all_done, produced = jax.device_get(
                    (
                        decoding.step,
                        jnp.all(decoding.done_B[: batch.rows]),
                        jnp.sum(decoding.out_BxO[: batch.rows] >= 0),
                    )
                )
                last = bool(all_done) or int(step) >= max_new_tokens
                if on_progress is not None:  # a batch counts as done in proportion to its decode steps
                    share = 1.0 if last else int(step) / max_new_tokens
                    on_progress(batch.start + share * batch.rows, int(produced) - tokens)
                tokens = int(produced)
                if last:
                    break
            out = np.asarray(decoding.out_BxO)
            # The decode program compiles on the prefill's output, inside the timed span: its compile is
            # taken out (a batch's first call of a new bucket would otherwise count seconds of it).
            seconds = time.perf_counter() - begin - (self.compile_seconds - compiling)
            produced_BxO = (out >= 0) & ~np.isin(out, self.eos_ids)
            counts = np.cumprod(produced_BxO, axis=1).sum(axis=1)
            generated = int(counts[: batch.rows].sum())
            self.stats.seconds += seconds
            self.stats.prompt_tokens += batch.prompt_tokens
            self.stats.generated_tokens += generated
            self.stats.per_batch_tokens.append(generated)
            self.stats.per_batch_seconds.append(seconds)
            results.extend(out[row, : counts[row]].tolist() for row in range(batch.rows))
        self.stats.compile_seconds = self.compile_seconds
        if order is None:
            return results
        restored: list[list[int]] = [[] for _ in prompts]
        for position, index in enumerate(order):
            restored[index] = results[position]
        return restored


class Decoder(Protocol):
    """Anything that continues token prompts: `Generator`, or a speculative decoder."""

    def generate(
        self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, params: SamplingParams, seed: int
    ) -> list[list[int]]: ...


def generate_replies(
    generator: Decoder,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    conversations: Sequence[Sequence[str]],
    *,
    max_new_tokens: int,
    params: SamplingParams = GREEDY,
    seed: int = 0,
) -> list[tuple[list[str], list[list[int]]]]:
    """Target replies for every user turn of every conversation, `(replies, reply_ids)` each.

    Turn k of a conversation is answered with the conversation's earlier user turns and the
    target's own earlier replies in context; conversations are batched turn by turn.
    """
    replies: list[list[str]] = [[] for _ in conversations]
    reply_ids: list[list[list[int]]] = [[] for _ in conversations]
    for turn in range(max((len(c) for c in conversations), default=0)):
        active = [i for i, conv in enumerate(conversations) if len(conv) > turn]
        prompts = []
        for i in active:
            messages = []
            for user, reply in zip(conversations[i][:turn], replies[i]):
                messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
            messages.append({"role": "user", "content": conversations[i][turn]})
            prompts.append(prompt_ids(tokenizer, template, messages).tolist())
        outputs = generator.generate(prompts, max_new_tokens=max_new_tokens, params=params, seed=seed + turn)
        for i, ids in zip(active, outputs):
            reply_ids[i].append(ids)
            replies[i].append(tokenizer.decode(ids, skip_special_tokens=True))
    return list(zip(replies, reply_ids))
