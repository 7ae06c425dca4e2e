"""DSpark training objective and teacher-forced offline metrics (docs/design.md section 1), by anchor chunk.

Notation: shape letters follow the legend in `dspark_jax/__init__.py` (`B` samples, `N` anchors
(blocks) per sample, `S = 7` predictions per block, `H` hidden size, `V` vocabulary, `C` anchors per
chunk). Prediction `i` of the block at anchor `a` predicts `x[a+1+i]` (`labels`), its teacher is
`p_i = softmax(S[a+i] @ lm_head)` (`teacher_hidden` holds `S[a+i]`, the design notes' name for the target's
post-norm final state: a value, not the shape letter `S`), the draft distribution is
`q_i = softmax(l_i)` with the Markov-corrected logits `l_i` of a caller-supplied head, and the overlap
is `a_i = sum_v min(p_i, q_i)`. With `w_i = exp(-i/4) * eval_mask_i`:

    L = 0.1 * CE + 0.9 * L1 + 1.0 * BCE,   each term = sum(w * term) / sum(w),

`CE = -log q_i[label]`, `L1 = sum_v |p_i - q_i|`, `BCE` = binary cross-entropy with logits of the
confidence logit `s_i` against the soft target `stop_gradient(a_i)`.

Global normalisation. Numerators and denominators are summed over the *global* batch (all devices
and all micro-batches of one optimizer step) before dividing, so `block_objective_sums` returns sums
and `loss_from_sums` / `metrics_from_sums` divide them. A trainer differentiates the loss
*numerators* per micro-batch, adds gradients and sums over the step, and divides once at the end by
the summed denominators (`LossTerms`), all on device: denominators that depend on the step's own
computation (Draft Memory's dropped transitions, a rank loss's hit set) never visit the host.

Memory. The vocabulary tensors (`[B, C, S, V]` logits, probabilities, log-probabilities for teacher
and draft) exist for one chunk of `C` anchors at a time: chunks run under `jax.lax.scan` and each chunk
body is wrapped in `jax.checkpoint`, so the backward pass recomputes them chunk by chunk instead of
storing them for all `N` anchors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import jax
import jax.numpy as jnp

from dspark_jax import sharding

POSITION_DECAY = 4.0

# A loss is a sum of groups; each group is `sum(coefficient * numerator) / denominator`, every name a
# key of the sums. The DSpark loss is one group over the position weights.
LossTerms = Mapping[str, Mapping[str, float]]
DSPARK_LOSS: LossTerms = {"weight": {"ce": 0.1, "l1": 0.9, "bce": 1.0}}

HeadFn = Callable[[dict[str, jax.Array]], Mapping[str, jax.Array | Mapping[str, jax.Array]]]

_RECORDERS: list[list[dict[str, jax.Array]]] = []
_BLOCKS = "_blocks"
# A `teacher_sums` entry that is not a sum: the per-prediction acceptance `[B, C, S]` a group's own tau_prob
# and accept rates use, where that is not `overlap` (the prefix reranker's reranked distribution).
FIGURE_OVERLAP = "figure_overlap"


@contextlib.contextmanager
def recording_blocks() -> Iterator[list[dict[str, jax.Array]]]:
    """While tracing inside this context, every `block_objective_sums` call also appends its per-block
    records to the yielded list: f32 `[B, N, S]` arrays `confidence_logit`, `greedy_accept` (the draft's
    argmax equals the teacher's), `overlap` (`a_i`, the acceptance probability of sampling) and
    `eval_mask`, and `figure_overlap` (the acceptance the group's own tau_prob counts: `overlap`, or what
    its `teacher_sums` gives under `FIGURE_OVERLAP`). Any experiment's evaluation sums give the records this
    way (the STS calibration and the report's per-sample sums read them) without a separate forward per
    group.
    """
    records: list[dict[str, jax.Array]] = []
    _RECORDERS.append(records)
    try:
        yield records
    finally:
        _RECORDERS.pop()


def position_weights(eval_mask_xS: jax.Array) -> jax.Array:
    """Loss weights `w_i = exp(-i / POSITION_DECAY) * eval_mask_i`: f32[..., S] for a mask [..., S]."""
    num_predictions = eval_mask_xS.shape[-1]
    decay_S = jnp.exp(-jnp.arange(num_predictions, dtype=jnp.float32) / POSITION_DECAY)
    return decay_S * eval_mask_xS.astype(jnp.float32)


def _chunk_sums(
    head_fn: HeadFn,
    lm_head_HxV: jax.Array,
    vocab_ids_K: jax.Array | None,
    inputs: dict[str, jax.Array],
    teacher_hidden_BxCxSxH: jax.Array,
    labels_BxCxS: jax.Array,
    eval_mask_BxCxS: jax.Array,
    record: bool = False,
) -> dict[str, jax.Array]:
    """All sums of one chunk of `C` anchors; see `block_objective_sums` for the keys (`record` adds the
    chunk's per-block records under `_BLOCKS`, see `recording_blocks`)."""
    out = head_fn(inputs)
    logits_BxCxSxK = sharding.constrain(out["logits"].astype(jnp.float32), ("batch", None, None, "vocab"))
    conf_logit_BxCxS = out["confidence_logit"].astype(jnp.float32)
    teacher_logits_BxCxSxV = jnp.einsum(
        "bcsh,hv->bcsv",
        teacher_hidden_BxCxSxH,
        jax.lax.stop_gradient(lm_head_HxV),
        preferred_element_type=jnp.float32,
    )
    p_BxCxSxV = jax.nn.softmax(teacher_logits_BxCxSxV, axis=-1)
    log_q_BxCxSxK = jax.nn.log_softmax(logits_BxCxSxK, axis=-1)
    q_BxCxSxK = jnp.exp(log_q_BxCxSxK)

    mask_BxCxS = eval_mask_BxCxS.astype(jnp.float32)
    valid_BxCxS = mask_BxCxS > 0
    column_BxCxS = labels_BxCxS.astype(jnp.int32)  # each label's column of the draft's logits
    has_column_BxCxS = True
    if vocab_ids_K is None:  # the draft covers the whole vocabulary: K = V
        p_BxCxSxK, p_outside_BxCxS, greedy_BxCxS = p_BxCxSxV, 0.0, jnp.argmax(logits_BxCxSxK, -1)
    else:  # q is 0 outside the draft vocabulary: its teacher mass there counts whole in L1
        p_BxCxSxK = jnp.take(p_BxCxSxV, vocab_ids_K, axis=-1)
        p_outside_BxCxS = jnp.maximum(1.0 - jnp.sum(p_BxCxSxK, axis=-1), 0.0)
        greedy_BxCxS = vocab_ids_K[jnp.argmax(logits_BxCxSxK, -1)]
        # A label outside the vocabulary has no column: its CE term is 0 (the draft cannot propose it).
        found_BxCxS = jnp.minimum(jnp.searchsorted(vocab_ids_K, column_BxCxS), vocab_ids_K.shape[0] - 1)
        has_column_BxCxS = vocab_ids_K[found_BxCxS] == column_BxCxS
        column_BxCxS = found_BxCxS
    ce_BxCxS = -jnp.take_along_axis(log_q_BxCxSxK, column_BxCxS[..., None], axis=-1)[..., 0]
    ce_BxCxS = jnp.where(has_column_BxCxS, ce_BxCxS, 0.0)
    l1_BxCxS = jnp.sum(jnp.abs(p_BxCxSxK - q_BxCxSxK), axis=-1) + p_outside_BxCxS
    overlap_BxCxS = jax.lax.stop_gradient(jnp.sum(jnp.minimum(p_BxCxSxK, q_BxCxSxK), axis=-1))
    bce_BxCxS = jax.nn.softplus(conf_logit_BxCxS) - overlap_BxCxS * conf_logit_BxCxS
    conf_err_BxCxS = jax.nn.sigmoid(conf_logit_BxCxS) - overlap_BxCxS

    weight_BxCxS = position_weights(mask_BxCxS)
    # Confidence calibration along the block, as DeepSpec logs it: predicted vs actual prefix acceptance.
    conf_prefix_BxCxS = jnp.cumprod(jax.nn.sigmoid(conf_logit_BxCxS) * mask_BxCxS, axis=-1)
    accept_prefix_BxCxS = jnp.cumprod(overlap_BxCxS * mask_BxCxS, axis=-1)

    def masked(term_BxCxS: jax.Array, scale_BxCxS: jax.Array) -> jax.Array:
        return jnp.sum(scale_BxCxS * jnp.where(valid_BxCxS, term_BxCxS, 0.0))

    accepted_BxCxS = jnp.where(valid_BxCxS, overlap_BxCxS * mask_BxCxS, 0.0)
    valid_block_BxC = mask_BxCxS[..., 0] > 0
    tau_BxC = 1.0 + jnp.sum(jnp.cumprod(accepted_BxCxS, axis=-1), axis=-1)
    sums = {
        "ce": masked(ce_BxCxS, weight_BxCxS),
        "l1": masked(l1_BxCxS, weight_BxCxS),
        "bce": masked(bce_BxCxS, weight_BxCxS),
        "weight": jnp.sum(weight_BxCxS),
        "ce_unweighted": masked(ce_BxCxS, mask_BxCxS),
        "l1_unweighted": masked(l1_BxCxS, mask_BxCxS),
        "bce_unweighted": masked(bce_BxCxS, mask_BxCxS),
        "tau": jnp.sum(jnp.where(valid_block_BxC, tau_BxC, 0.0)),
        "blocks": jnp.sum(valid_block_BxC.astype(jnp.float32)),
        "accept": jnp.sum(accepted_BxCxS, axis=(0, 1)),
        "accept_count": jnp.sum(mask_BxCxS, axis=(0, 1)),
        "conf_abs_err": masked(jnp.abs(conf_err_BxCxS), weight_BxCxS),
        "conf_bias": masked(conf_err_BxCxS, weight_BxCxS),
        "conf_cumprod_bias": masked(conf_prefix_BxCxS - accept_prefix_BxCxS, weight_BxCxS),
        "predictions": jnp.sum(mask_BxCxS),
    }
    extra = dict(out.get("extra_sums", {}))
    if "teacher_sums" in out:
        extra |= out["teacher_sums"](jax.lax.stop_gradient(p_BxCxSxV), labels_BxCxS, mask_BxCxS)
    figure_overlap_BxCxS = extra.pop(FIGURE_OVERLAP, overlap_BxCxS)
    extra = {name: jnp.asarray(value, jnp.float32) for name, value in extra.items()}
    if clash := sorted(set(extra) & set(sums)):
        raise ValueError(f"head_fn extra_sums reuse reserved names {clash}")
    if record:
        greedy_accept_BxCxS = greedy_BxCxS == jnp.argmax(teacher_logits_BxCxSxV, -1)
        extra[_BLOCKS] = {
            "confidence_logit": conf_logit_BxCxS,
            "greedy_accept": greedy_accept_BxCxS.astype(jnp.float32),
            "overlap": overlap_BxCxS,
            "eval_mask": mask_BxCxS,
            "figure_overlap": jnp.asarray(figure_overlap_BxCxS, jnp.float32),
        }
    return sums | extra


def block_objective_sums(
    head_fn: HeadFn,
    head_inputs: Mapping[str, jax.Array],
    teacher_hidden_BxNxSxH: jax.Array,
    lm_head_HxV: jax.Array,
    labels_BxNxS: jax.Array,
    eval_mask_BxNxS: jax.Array,
    *,
    anchor_chunk: int,
    remat: bool = True,
    vocab_ids_K: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """Loss numerators, denominators and metric sums of `B x N` blocks, `anchor_chunk` anchors at a time.

    `head_fn(chunk_inputs)` gets `{k: v[:, n0:n0+C]}` for every `head_inputs` entry (all sliced along
    the anchor axis 1; the trainable parameters live in `head_fn`'s closure) and returns
    `logits` f32[B, C, S, V] (the corrected draft logits `l_i`), `confidence_logit` f32[B, C, S] and
    optionally `extra_sums` (a dict of arrays, summed over chunks) and `teacher_sums`, a function
    `(p [B, C, S, V], labels, eval_mask) -> dict of sums` for sums that need the teacher distribution.
    `N` is padded up to a multiple of `C = min(anchor_chunk, N)` with zeros (eval_mask 0), so `head_fn`
    must stay finite on zero inputs.

    Inputs: `teacher_hidden_BxNxSxH` = `S[a+i]` (bf16 is fine), `lm_head_HxV` (frozen: stop_gradient),
    `labels_BxNxS` int = `x[a+1+i]`, `eval_mask_BxNxS` 0/1, cumulative over i and 0 on padded blocks.
    Teacher logits accumulate in fp32; all losses are fp32. `remat=False` keeps every chunk's
    vocabulary tensors for the backward pass instead of recomputing them (one forward less, `N / C`
    times the memory; a CPU demo's choice).

    Draft vocabulary. With `vocab_ids_K` (the ascending ids of a draft vocabulary, `FrozenTarget.draft_vocab`)
    the draft's logits are `[B, C, S, K]` over those ids only and `q` is 0 elsewhere; the teacher `p` keeps
    the whole vocabulary, so the sums are those of that `q` against the same `p`: `L1` adds the teacher's
    mass outside the `K` ids, `a_i` sums over them, and a label outside them adds no CE (it is still a
    valid prediction: weights, tau and accept rates count it, with the acceptance the draft gets).

    Returns f32 sums: `ce`, `l1`, `bce` (position-weighted numerators), `weight` (sum of `w`),
    `ce_unweighted`, `l1_unweighted`, `bce_unweighted` (over valid predictions, no decay), `tau` (sum
    of per-block tau_prob over valid blocks), `blocks` (valid blocks: `eval_mask[..., 0] = 1`),
    `accept` [S] (sum of `a_i * eval_mask_i`), `accept_count` [S] (sum of `eval_mask_i`),
    `conf_abs_err`, `conf_bias` and `conf_cumprod_bias` (position-weighted sums of
    `|sigmoid(s_i) - a_i|`, `sigmoid(s_i) - a_i` and
    `cumprod_i(sigmoid(s_i) * mask_i) - cumprod_i(a_i * mask_i)`), `predictions` (valid
    predictions), plus the `extra_sums` of `head_fn`.
    """
    record = bool(_RECORDERS)
    body = lambda chunk_xs: _chunk_sums(head_fn, lm_head_HxV, vocab_ids_K, *chunk_xs, record=record)
    xs = (dict(head_inputs), teacher_hidden_BxNxSxH, labels_BxNxS, eval_mask_BxNxS)
    per_chunk = scan_anchor_chunks(body, xs, anchor_chunk, remat=remat)
    if record:
        num_anchors = labels_BxNxS.shape[1]
        _RECORDERS[-1].append(
            {k: from_anchor_chunks(v, num_anchors) for k, v in per_chunk.pop(_BLOCKS).items()}
        )
    return jax.tree.map(lambda x: jnp.sum(x, axis=0), per_chunk)


def scan_anchor_chunks(fn: Callable, inputs, anchor_chunk: int, *, remat: bool = False):
    """`fn` over chunks of `C = min(anchor_chunk, N)` anchors under `jax.lax.scan`: outputs `[N / C, ...]`.

    Every leaf of `inputs` is `[B, N, ...]` and is cut along the anchor axis 1 (zero-padded up to a
    multiple of `C`); `fn` gets one chunk (`[B, C, ...]` leaves) and its outputs are stacked along a new
    leading chunk axis. `remat` wraps `fn` in `jax.checkpoint` (the backward pass recomputes each chunk).
    Vocabulary-sized work done per chunk is never live for all `N` anchors at once.
    """
    if anchor_chunk < 1:
        raise ValueError(f"anchor_chunk must be >= 1, got {anchor_chunk}")
    num_anchors = jax.tree.leaves(inputs)[0].shape[1]
    chunk = min(anchor_chunk, num_anchors)
    num_chunks = -(-num_anchors // chunk)
    pad = num_chunks * chunk - num_anchors

    def to_chunks(x: jax.Array) -> jax.Array:
        """[B, N, ...] -> [num_chunks, B, C, ...], zero-padded along N."""
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        chunked = x.reshape(x.shape[0], num_chunks, chunk, *x.shape[2:])  # [B, num_chunks, C, ...]
        return jnp.moveaxis(chunked, 1, 0)

    if remat:
        fn = jax.checkpoint(fn, prevent_cse=False)
    _, per_chunk = jax.lax.scan(lambda carry, xs: (carry, fn(xs)), None, jax.tree.map(to_chunks, inputs))
    return per_chunk


def from_anchor_chunks(stacked: jax.Array, num_anchors: int) -> jax.Array:
    """Per-anchor outputs of `scan_anchor_chunks` (`[N / C, B, C, ...]`) back to `[B, N, ...]`."""
    num_chunks, b, c = stacked.shape[:3]
    merged = jnp.moveaxis(stacked, 0, 1).reshape(b, num_chunks * c, *stacked.shape[3:])
    return merged[:, :num_anchors]


def safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
    """`num / den`, 0 where `den == 0` (gradient-safe)."""
    nonzero = den > 0
    return jnp.where(nonzero, num / jnp.where(nonzero, den, 1.0), 0.0)


def loss_numerators(sums: Mapping[str, jax.Array], terms: LossTerms = DSPARK_LOSS) -> jax.Array:
    """f32[loss groups]: each group's numerator `sum(coefficient * sums[name])`, groups in `terms` order."""
    return jnp.stack([sum(c * sums[name] for name, c in group.items()) for group in terms.values()])


def loss_denominators(sums: Mapping[str, jax.Array], terms: LossTerms = DSPARK_LOSS) -> jax.Array:
    """f32[loss groups]: each loss group's (globally summed) denominator."""
    return jnp.stack([jnp.asarray(sums[name], jnp.float32) for name in terms])


def normalise(numerators: jax.Array, denominators: jax.Array) -> jax.Array:
    """`numerators / denominators` per group, 0 for an empty group (a group with no valid prediction)."""
    return safe_div(numerators, denominators)


def loss_from_sums(sums: Mapping[str, jax.Array], terms: LossTerms = DSPARK_LOSS) -> jax.Array:
    """The loss of globally summed `sums`: the sum of the normalised groups."""
    return jnp.sum(normalise(loss_numerators(sums, terms), loss_denominators(sums, terms)))


def metrics_from_sums(sums: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Scalar metrics of globally summed `sums` (`extra_sums` entries are left to the caller).

    Keys: `loss` (the DSpark loss); `ce`, `l1`, `bce` (position-weighted, as in the loss);
    `ce_per_token`, `l1_per_token`, `bce_per_token` (plain means over valid predictions); `tau_prob`;
    `accept_rate_0` .. `accept_rate_{S-1}`; `confidence_abs_error`, `confidence_bias`,
    `confidence_cumprod_bias` (position-weighted means, as DeepSpec logs them); `valid_blocks`,
    `valid_predictions`. Ratios with a zero denominator are 0.
    """
    weight, predictions = sums["weight"], sums["predictions"]
    metrics = {
        "loss": loss_from_sums(sums),
        **{name: safe_div(sums[name], weight) for name in ("ce", "l1", "bce")},
        **{
            f"{name}_per_token": safe_div(sums[f"{name}_unweighted"], predictions)
            for name in ("ce", "l1", "bce")
        },
        "tau_prob": safe_div(sums["tau"], sums["blocks"]),
        "confidence_abs_error": safe_div(sums["conf_abs_err"], weight),
        "confidence_bias": safe_div(sums["conf_bias"], weight),
        "confidence_cumprod_bias": safe_div(sums["conf_cumprod_bias"], weight),
        "valid_blocks": sums["blocks"],
        "valid_predictions": predictions,
    }
    accept_rate_S = safe_div(sums["accept"], sums["accept_count"])
    metrics |= {f"accept_rate_{i}": accept_rate_S[i] for i in range(accept_rate_S.shape[0])}
    return metrics
