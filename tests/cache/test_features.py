"""Cache features against a direct, unpadded, unbatched target forward.

The extractor runs padded batches of one length bucket; float32 reductions over a padded
length may round differently in the last bit, so after the cast to bf16 a rare element
may sit one bf16 step away. Everything else must be bit-identical.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from dspark_jax import sharding
from dspark_jax.cache.features import FeatureExtractor
from dspark_jax.target.config import TargetConfig
from dspark_jax.target.model import Transformer

CFG = TargetConfig(
    family="llama",
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=512,
)


def _bf16_bits_close(got, want_f32):
    want = want_f32.astype(ml_dtypes.bfloat16)
    assert got.dtype == ml_dtypes.bfloat16 and got.shape == want.shape
    steps = np.abs(got.view(np.uint16).astype(np.int32) - want.view(np.uint16).astype(np.int32))
    assert (steps == 0).mean() > 0.99 and steps.max() <= 2


def test_features_match_direct_forward(mesh1):
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, jax.device_put(state, sharding.state_shardings(state, mesh1)))
    rng = np.random.RandomState(0)
    sequences = [rng.randint(0, 128, n).astype(np.int32) for n in (5, 17, 16, 40, 70)]
    got = FeatureExtractor(model, (-1, 1, 2), tokens_per_batch=128, mesh=mesh1)(sequences)
    direct = jax.jit(lambda ids: model(ids, aux_layer_ids=(-1, 1, 2)))
    for ids, (aux, last) in zip(sequences, got):
        out = direct(jnp.asarray(ids[None]))
        _bf16_bits_close(aux, np.asarray(out.aux_BxTxAxH[0]))
        _bf16_bits_close(last, np.asarray(out.hidden_BxTxH[0]))
