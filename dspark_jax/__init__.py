"""dspark_jax: DSpark speculative-decoding block drafts in JAX/Flax, trained against a frozen target.

Shape legend
------------
Tensor names end in their shape, one letter per axis joined by `x` (nanodo style):
`h_BxNxSxH` is a `[B, N, S, H]` array. Shapes written in docstrings (`[B, N, S, H]`) use the
same letters. Every name in the package, its tests and benchmarks follows this one legend:

  B  batch rows
  T  sequence positions (tokens, context, KV-cache slots)
  P  prompt length
  O  output slots
  N  blocks (anchors) per row
  C  blocks per chunk
  S  slots per block = predictions per block (the block size, 7)
  M  memory slots per block
  H  hidden width
  V  vocabulary
  A  aux layers
  R  Markov rank
  F  rotary frequencies (D/2)
  L  layers
  K  candidates per slot (top-K), or the tokens of a draft vocabulary
  U  hashed n-gram feature width (Z * W)
  Z  n-gram hash heads (orders x heads per order)
  W  row width of one hash head

  attention:
  Q  query heads
  G  KV heads (the key heads of a linear-attention layer)
  E  query heads per KV head (Q/G; value heads per key head, J/G, in linear attention)
  D  head dim (the key head dim in linear attention)

  linear attention (Gated DeltaNet) and mixture of experts:
  J  value heads of a linear-attention layer
  Y  value head dim of a linear-attention layer
  X  experts
  I  intermediate width of an MLP or expert

Juxtaposed letters are a flattened product: `h_BxNSxH` is `[B, N*S, H]`. A digit adds to the
letter before it: `S1` = S + 1 (`target_logits_BxS1xV`). A bare `1` is an axis of size one
(`rows_Bx1`). A leading `x` stands for any leading dims: `h_xH` is `[..., H]`.
"""
