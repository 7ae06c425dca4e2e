"""Engram n-gram hashing: token-id compression, seeded multipliers, distinct prime table sizes.

Follows DeepSeek's public Engram conventions (docs/design.md, "Engram table") so a table a target ships
loads as is:

  compression  each token id is decoded and normalised (NFKC, NFD, accents stripped, lowercase,
               whitespace runs to one space, a lone space kept, stripped); ids with equal keys share a
               compressed id, numbered in first-seen order; a decoding with U+FFFD keys on the raw
               token string instead, an empty normalisation on the decoded text;
  n-grams      for position t and order n = 2..N the compressed ids `c_0 = c[t], c_1 = c[t-1], ...,
               c_{n-1}` (positions before the sequence start take the compressed pad id);
  mix          `c_0 * m_0 XOR c_1 * m_1 XOR ... XOR c_{n-1} * m_{n-1}` in int64, with odd multipliers
               `m = 2 * rng.integers(0, half_bound, N) + 1`, `rng = default_rng(seed + 10007 * layer_id)`,
               `half_bound = max(1, (int64_max // compressed_vocab) // 2)`;
  heads        head j of order n indexes its own table of prime size `p_{n,j}`: `mix mod p_{n,j}`;
               primes are searched upward from `table_size // heads` per order, each one the next
               unused prime after the previous head's, distinct across every order and head.

Since every compressed id is below `compressed_vocab` and every multiplier below
`int64_max // compressed_vocab`, no product overflows and `mix` is a non-negative int64. The device
version (`device_hashes`) computes the same bits with uint32 limbs, so it needs no `jax_enable_x64`.
Hash head `z` (the legend's `Z` axis) is order `2 + z // heads`, head `z % heads`.
"""

from __future__ import annotations

import dataclasses
import re
import unicodedata

import jax
import jax.numpy as jnp
import numpy as np

REPLACEMENT_CHAR = "\ufffd"
_SENTINEL = "\ue000"
_WHITESPACE_RUN = re.compile(r"[ \t\r\n]+")
_INT64_MAX = np.iinfo(np.int64).max
# The device's modular reduction works a byte at a time in uint32: table sizes must stay below 2^24.
MAX_TABLE_PRIME = 1 << 24


def normalize_key(text: str) -> str:
    """The compression key of a decoded token: NFKC, NFD, accents stripped, lowercase, whitespace runs
    to one space, a text that is only a space kept as a space, stripped."""
    text = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    text = "".join(ch for ch in text if unicodedata.category(ch) != "Mn").lower()
    text = _WHITESPACE_RUN.sub(" ", text)
    if text == " ":
        text = _SENTINEL
    return text.strip().replace(_SENTINEL, " ")


def compression_map(tokenizer) -> np.ndarray:
    """int64[V]: the compressed id of every token id of `tokenizer` (a `target.tokenizer.Tokenizer`)."""
    ids = np.empty(tokenizer.vocab_size, np.int64)
    numbering: dict[str, int] = {}
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.decode([token_id])
        if REPLACEMENT_CHAR in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalize_key(text) or text
        ids[token_id] = numbering.setdefault(key, len(numbering))
    return ids


def _is_prime(n: int) -> bool:
    if n < 4:
        return n > 1
    if n % 2 == 0 or n % 3 == 0:
        return False
    k = 5
    while k * k <= n:
        if n % k == 0 or n % (k + 2) == 0:
            return False
        k += 6
    return True


def table_primes(max_order: int, heads: int, table_size: int) -> tuple[int, ...]:
    """Distinct prime table sizes, order by order (2..max_order), head by head."""
    seen: set[int] = set()
    primes = []
    for _ in range(2, max_order + 1):
        candidate = table_size // heads
        for _ in range(heads):
            candidate += 1
            while not _is_prime(candidate) or candidate in seen:
                candidate += 1
            seen.add(candidate)
            primes.append(candidate)
    if primes and primes[-1] >= MAX_TABLE_PRIME:
        raise ValueError(
            f"Engram table size {table_size} gives per-head tables up to {primes[-1]} rows; "
            f"the device hashing supports fewer than {MAX_TABLE_PRIME}: lower engram.table_multiplier"
        )
    return tuple(primes)


def multipliers(seed: int, layer_id: int, max_order: int, compressed_vocab: int) -> tuple[int, ...]:
    """The `max_order` odd int64 multipliers of one Engram layer."""
    half_bound = max(1, (_INT64_MAX // compressed_vocab) // 2)
    rng = np.random.default_rng(seed + 10007 * layer_id)
    return tuple(int(m) for m in rng.integers(0, half_bound, size=max_order, dtype=np.int64) * 2 + 1)


@dataclasses.dataclass(frozen=True)
class HashSpec:
    """Everything that fixes the hash ids (stored with a table).

    Attributes:
      max_order: the largest n-gram order N (orders 2..N).
      heads: hash heads per order (K).
      head_dim: feature width of one head's row.
      seed, layer_id: the multipliers' seed (`seed + 10007 * layer_id`).
      compressed_vocab: number of compressed ids.
      pad_id: the compressed id of positions before the sequence start.
      multipliers: N odd int64 multipliers.
      primes: (N-1) * K distinct prime table sizes, order-major.
    """

    max_order: int
    heads: int
    head_dim: int
    seed: int
    layer_id: int
    compressed_vocab: int
    pad_id: int
    multipliers: tuple[int, ...]
    primes: tuple[int, ...]

    @classmethod
    def create(
        cls, *, max_order, heads, head_dim, seed, layer_id, compressed_vocab, pad_id, table_size
    ) -> HashSpec:
        if max_order < 2 or heads < 1 or head_dim < 1:
            raise ValueError(
                f"Engram needs max_order >= 2, heads, head_dim >= 1; got {max_order}, {heads}, {head_dim}"
            )
        return cls(
            max_order,
            heads,
            head_dim,
            seed,
            layer_id,
            compressed_vocab,
            pad_id,
            multipliers(seed, layer_id, max_order, compressed_vocab),
            table_primes(max_order, heads, table_size),
        )

    @property
    def num_hashes(self) -> int:
        """Hash heads over all orders (Z)."""
        return (self.max_order - 1) * self.heads

    @property
    def dim(self) -> int:
        """Feature width (U): every (order, head) row concatenated."""
        return self.num_hashes * self.head_dim

    @property
    def offsets(self) -> np.ndarray:
        """int64[Z]: the first row of each head's table in the concatenated table."""
        return np.concatenate([[0], np.cumsum(self.primes)[:-1]]).astype(np.int64)

    @property
    def num_rows(self) -> int:
        return int(sum(self.primes))


def suffix_ngrams(compressed_xT: np.ndarray, positions_xT: np.ndarray, max_order: int, pad_id: int):
    """The compressed ids `c[t - k]` (k = 0..N-1) of the n-grams ending at each position, `[..., T, N]`;
    `positions_xT` count from each sequence's start (packed rows restart at every sample), earlier
    positions are `pad_id`. Works on numpy and jax arrays alike."""
    xp = jnp if isinstance(compressed_xT, jax.Array) else np
    length = compressed_xT.shape[-1]
    pad = [(0, 0)] * (compressed_xT.ndim - 1) + [(max_order, 0)]
    padded = xp.pad(compressed_xT, pad)  # c[t - k] = padded[t + N - k]
    columns = [
        xp.where(positions_xT >= k, padded[..., max_order - k : max_order - k + length], pad_id)
        for k in range(max_order)
    ]
    return xp.stack(columns, axis=-1)


def host_hashes(spec: HashSpec, compressed_xT: np.ndarray, positions_xT: np.ndarray) -> np.ndarray:
    """int64 `[..., T, Z]` row index of each hash head inside its own table (numpy int64 arithmetic)."""
    grams_xTxN = suffix_ngrams(
        np.asarray(compressed_xT, np.int64), np.asarray(positions_xT), spec.max_order, spec.pad_id
    )
    mult_N = np.asarray(spec.multipliers, np.int64)
    heads = []
    for n in range(2, spec.max_order + 1):
        mix = grams_xTxN[..., 0] * mult_N[0]
        for k in range(1, n):
            mix = np.bitwise_xor(mix, grams_xTxN[..., k] * mult_N[k])
        first = (n - 2) * spec.heads
        heads += [mix % p for p in spec.primes[first : first + spec.heads]]
    return np.stack(heads, axis=-1)


# --- The same bits on device with uint32 limbs (no x64). ---


def split_int64(values) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative int64 values as (high, low) uint32 words."""
    values = np.asarray(values, np.uint64)
    return (values >> np.uint64(32)).astype(np.uint32), (values & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def _mul_hi(a, b):
    """High 32 bits of the 64-bit product of uint32 `a` and `b` (16-bit partial products)."""
    mask = jnp.uint32(0xFFFF)
    a0, a1 = a & mask, a >> 16
    b0, b1 = b & mask, b >> 16
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> 16) + (p01 & mask) + (p10 & mask)
    return p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16)


def _mod_u64(hi, lo, p):
    """`(hi * 2^32 + lo) mod p` for uint32 words and a modulus `p < 2^24` (Horner, a byte at a time)."""
    r = hi % p
    for shift in (24, 16, 8, 0):
        r = ((r << 8) | ((lo >> shift) & jnp.uint32(0xFF))) % p
    return r


def device_hashes(
    mult_hi_N, mult_lo_N, primes_Z, compressed_xT, positions_xT, *, max_order: int, heads: int, pad_id: int
):
    """`host_hashes` in jax with uint32 arithmetic, bit for bit: int32 `[..., T, Z]`.

    `mult_hi_N, mult_lo_N` are the multipliers' words (`split_int64`), `primes_Z` uint32 table sizes.
    """
    grams_xTxN = suffix_ngrams(
        jnp.asarray(compressed_xT).astype(jnp.uint32), jnp.asarray(positions_xT), max_order, pad_id
    ).astype(jnp.uint32)
    heads_out = []
    mix_hi = mix_lo = None
    for k in range(max_order):
        c = grams_xTxN[..., k]
        lo = c * mult_lo_N[k]  # wraps mod 2^32: the low word of the product
        hi = _mul_hi(c, mult_lo_N[k]) + c * mult_hi_N[k]
        mix_hi, mix_lo = (hi, lo) if k == 0 else (mix_hi ^ hi, mix_lo ^ lo)
        if k >= 1:  # order n = k + 1 is complete
            first = (k - 1) * heads
            heads_out += [_mod_u64(mix_hi, mix_lo, primes_Z[z]) for z in range(first, first + heads)]
    return jnp.stack(heads_out, axis=-1).astype(jnp.int32)
