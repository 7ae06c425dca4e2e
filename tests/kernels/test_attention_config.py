"""Block attention from the config: the Pallas tiles as config keys, their validation, and the dispatcher's
platform under a mesh (ahead-of-time compiles for a TPU topology from this CPU host)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractDevice, AbstractMesh

from configs import baseline
from dspark_jax.draft import model as model_lib
from dspark_jax.errors import UsageError
from dspark_jax.kernels import block_attention as ba
from dspark_jax.kernels.block_attention import BlockSizes
from dspark_jax.run import config_lib, draft_state
from dspark_jax.target import TargetConfig


def _config(**draft):
    config = baseline.get_config("smoke")
    for key, value in draft.items():
        config.draft[key] = value
    return config


def test_tile_keys_reach_the_kernel(monkeypatch):
    config = _config(attention_block_q=16, attention_block_k=64)
    seen = []

    def spy(*args, block_sizes, **kwargs):
        seen.append(block_sizes)
        return ba.block_attention(*args, block_sizes=block_sizes, **kwargs)

    monkeypatch.setattr(model_lib, "block_attention", spy)
    target = TargetConfig.from_json(config.target.arch.to_dict())
    draft = model_lib.DSparkDraft(draft_state.draft_config(config, target), rngs=nnx.Rngs(0))
    b, n, s, h = 1, 2, 7, target.hidden_size
    draft.backbone(jnp.zeros((b, n, s, h)), draft.context_kv(jnp.zeros((b, 16, h))), jnp.asarray([[3, 9]]))
    assert len(seen) == config.draft.num_layers and set(seen) == {BlockSizes(block_q=16, block_k=64)}


@pytest.mark.parametrize(
    ("draft", "message"),
    [
        (dict(attention_block_q=0), r"draft.attention_block_q=0 must be an integer >= 1"),
        (dict(attention_block_k=-8), r"draft.attention_block_k=-8 must be an integer >= 1"),
        (
            dict(attention="pallas", attention_block_q=4),
            r"draft.attention_block_q=4 x draft.block_size=7 query rows per tile must be a multiple of 8",
        ),
        (
            dict(attention="auto", attention_block_k=100),
            r"draft.attention_block_k=100 must be a multiple of 8",
        ),
    ],
)
def test_bad_tiles_name_the_key(draft, message):
    with pytest.raises(UsageError, match=message):
        config_lib.validate(_config(**draft))


def test_tiles_off_the_tpu_grid_are_fine_without_the_kernel():
    config_lib.validate(_config(attention="xla", attention_block_q=3, attention_block_k=100))


def test_stored_configs_without_the_keys_still_validate():
    config = baseline.get_config("smoke").to_dict()
    del config["draft"]["attention_block_q"], config["draft"]["attention_block_k"]
    config_lib.validate(config_lib.from_stored(config))


def test_dispatcher_compiles_for_the_mesh_platform():
    """Outside a mesh and under a mesh of local devices: the default backend; under a TPU mesh (e.g. a
    topology's compile-only devices) 'auto' picks the kernel whatever this host's backend."""
    local = jax.default_backend()
    assert ba.target_backend() == local
    assert ba.resolve_implementation("auto") == ("pallas" if local in ba.PALLAS_BACKENDS else "xla")
    tpu = AbstractMesh((1,), ("fsdp",), abstract_device=AbstractDevice("TPU v5", 1, "tpu"))
    with jax.sharding.use_abstract_mesh(tpu):
        assert ba.target_backend() == "tpu"
        assert ba.resolve_implementation("auto") == "pallas"
    with jax.set_mesh(jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("fsdp",))):
        assert ba.target_backend() == local
