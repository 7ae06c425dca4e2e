"""Run components: the draft built from the config's `draft` section, initialised under `jit` into the
config's sharding rules, equal to an eager initialisation."""

import importlib

import jax
import numpy as np
import pytest
from flax import nnx

from configs import base, baseline
from dspark_jax import sharding
from dspark_jax.draft.model import DraftConfig, DSparkDraft
from dspark_jax.errors import UsageError
from dspark_jax.run import draft_state, target_side
from dspark_jax.run import optimizer as optimizer_lib
from dspark_jax.target import TargetConfig


def _smoke():
    config = baseline.get_config("smoke")
    return config, TargetConfig.from_json(config.target.arch.to_dict())


def test_draft_config_is_the_whole_draft_section():
    config, target = _smoke()
    config.draft.mask_token_id = -1  # the presets' draft has a target row (16) as MASK
    cfg = draft_state.draft_config(config, target)
    assert {k: getattr(cfg, k) for k in config.draft} == {
        **config.draft.to_dict(),
        "mask_token_id": None,  # -1: a learned MASK vector
    }
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_aux) == (target.hidden_size, target.vocab_size, 3)
    with pytest.raises(ValueError, match=r"config\.draft\.hidden_size comes from the target"):
        DraftConfig.from_config({**config.draft.to_dict(), "hidden_size": 8}, target, 3)


def test_jit_init_matches_eager_init_and_follows_the_config_rules(mesh8):
    config, target = _smoke()
    _, params, _ = draft_state.init_draft(config, target, mesh8)
    eager = nnx.state(
        DSparkDraft(draft_state.draft_config(config, target), rngs=nnx.Rngs(config.seed)), nnx.Param
    )
    for (path, want), (_, got) in zip(nnx.to_flat_state(eager), nnx.to_flat_state(params)):
        # The same random draws; XLA fuses the init's scaling differently, so the last bit may differ.
        np.testing.assert_allclose(got.get_value(), want.get_value(), rtol=1e-6, atol=1e-9, err_msg=str(path))
    kernel = params["layers"][0]["mlp"]["gate"]["kernel"].get_value()
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")  # ('embed', 'mlp') by default
    # Another rules table in the config places the same parameters elsewhere.
    config.sharding.rules = tuple(
        (name, None if name == "embed" else axes) for name, axes in sharding.DEFAULT_RULES
    )
    _, params, _ = draft_state.init_draft(config, target, mesh8)
    spec = params["layers"][0]["mlp"]["gate"]["kernel"].get_value().sharding.spec
    assert spec == jax.sharding.PartitionSpec(None, "tensor")


def test_demo_arch_is_the_embedded_target_shape():
    """`target.arch` of the demo preset (used by shape-only tools) is the packaged SmolLM2's shape."""
    from dspark_jax.target.checkpoint import default_target_path, load_checkpoint

    want = load_checkpoint(default_target_path()).config.to_json()
    got = TargetConfig.from_json(baseline.get_config("demo").target.arch.to_dict()).to_json()
    assert got == {**want, "rms_norm_eps": got["rms_norm_eps"]}
    assert got["rms_norm_eps"] == pytest.approx(want["rms_norm_eps"])


@pytest.mark.parametrize("experiment", ["baseline", "reranker_frozen"])
def test_optimizer_state_is_sharded_like_the_parameters(mesh8, experiment):
    config = importlib.import_module(f"configs.{experiment}").get_config("smoke")
    target = TargetConfig.from_json(config.target.arch.to_dict())
    _, params, _ = draft_state.init_draft(config, target, mesh8)
    _, optimizer = optimizer_lib.make_training_optimizer(config, params)
    opt_state = optimizer_lib.init_optimizer_state(optimizer, params, mesh8)
    shardings = {jax.tree_util.keystr(p): x.sharding for p, x in jax.tree_util.tree_leaves_with_path(params)}
    moments = 0
    for path, x in jax.tree_util.tree_leaves_with_path(opt_state):
        name = jax.tree_util.keystr(path)
        owner = [k for k in shardings if name.endswith(k)]
        if owner:  # an Adam moment: laid out like its parameter, not whole on one device
            moments += 1
            assert x.sharding == shardings[max(owner, key=len)], name
        else:  # a step count
            assert x.sharding.is_fully_replicated and len(x.sharding.device_set) == 8, name
    assert moments >= 2 * (len(shardings) if experiment == "baseline" else 2)
    assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(opt_state))


def test_train_seed_changes_the_initialisation_and_defaults_to_the_global_seed(mesh1):
    """`train.seed` seeds the draft's initialisation (another draft), None keeps `seed`'s (the same one)."""
    config = baseline.get_config("smoke")
    target = TargetConfig.from_json(config.target.arch.to_dict())
    leaves = lambda c: np.concatenate(
        [np.ravel(x) for x in jax.tree.leaves(draft_state.init_draft(c, target, mesh1)[1])]
    )
    plain = leaves(config)
    config.train.seed = config.seed
    np.testing.assert_array_equal(leaves(config), plain)
    config.train.seed = config.seed + 1
    assert not np.array_equal(leaves(config), plain)


def test_layers_from_the_target_restore_exactly_its_tensors_and_keep_the_rest(mesh1):
    """`init.from_target_layers`: draft layer k holds target layer ids[k]'s norms, attention and MLP
    tensors bit for bit; the q/k norms a Llama target lacks and every other draft tensor keep the random
    init."""
    config, _ = _smoke()
    target = target_side.load_run_target(config, mesh1)
    read = target_side.target_reader(config, lambda: target)
    _, fresh, _ = draft_state.init_draft(config, target.config, mesh1)
    with config.unlocked():
        config.init.from_target_layers = (0, 2, -1)
    _, params, _ = draft_state.init_draft(config, target.config, mesh1, read)
    own = dict(nnx.to_flat_state(nnx.state(target.model)))
    copied = 0
    for path, var in nnx.to_flat_state(params):
        value, before = (
            np.asarray(var.get_value()),
            np.asarray(dict(nnx.to_flat_state(fresh))[path].get_value()),
        )
        source = ("layers", (0, 2, 4)[path[1]], *path[2:]) if path[0] == "layers" else None  # -1: the 5th
        if source in own:
            np.testing.assert_array_equal(value, np.asarray(own[source].get_value()), err_msg=str(path))
            copied += 1
        else:
            np.testing.assert_array_equal(value, before, err_msg=str(path))
    assert copied == 3 * 9  # 2 norms + q, k, v, o + gate, up, down per layer


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(layers=(0, 1)), r"names 2 target layers; the draft has draft.num_layers=3"),
        (dict(layers=(0, 1, 5)), r"layer 5 is not among the target's 5"),
        (dict(layers=(0, 1, 2), num_heads=2), r"set draft.num_heads=4, num_kv_heads=2, head_dim=16"),
    ],
)
def test_layers_from_the_target_refuse_a_wrong_count_layer_or_shape(mesh1, change, message):
    config, target = _smoke()
    with config.unlocked():
        config.init.from_target_layers = change["layers"]
        config.draft.num_heads = change.get("num_heads", config.draft.num_heads)
    with pytest.raises(UsageError, match=message):
        draft_state.init_draft(config, target, mesh1, lambda path, shape: np.zeros(shape))


def test_layers_from_a_hybrid_target_refuse_a_linear_attention_layer():
    config, _ = _smoke()
    target = TargetConfig.from_json(base.SMOKE_HYBRID_TARGET)
    with config.unlocked():
        config.init.from_target_layers = (0, 1, 3)
    with pytest.raises(UsageError, match=r"target layer 0 is a experts layer"):
        draft_state.target_layer_ids(config, target)


def test_a_context_from_an_aux_layer_is_that_layers_input_to_the_copied_target_layer(mesh1):
    """`init.context_from_aux=-1` with `from_target_layers`: the draft's context features of random aux
    states equal target layer ids[0]'s input norm of the last aux layer (how that layer reads its input)."""
    config, _ = _smoke()
    target = target_side.load_run_target(config, mesh1)
    read = target_side.target_reader(config, lambda: target)
    with config.unlocked():
        config.init.from_target_layers = (4, 4, 4)
        config.init.context_from_aux = -1
    graphdef, params, rest = draft_state.init_draft(config, target.config, mesh1, read)
    draft = nnx.merge(graphdef, params, rest)
    aux = np.random.default_rng(0).normal(size=(2, 5, 3, target.config.hidden_size)).astype(np.float32)
    want = target.model.layers[4].input_norm(aux[:, :, -1])
    np.testing.assert_allclose(np.asarray(draft.context(aux)), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_a_context_from_an_aux_layer_needs_target_layers_and_an_aux_index(mesh1):
    config, target = _smoke()
    with config.unlocked():
        config.init.context_from_aux = 0
    with pytest.raises(UsageError, match=r"context_from_aux=0 .* set init.from_target_layers too"):
        draft_state.init_draft(config, target, mesh1, lambda path, shape: np.zeros(shape))
    with config.unlocked():
        config.init.from_target_layers = (0, 1, 2)
        config.init.context_from_aux = 3
    with pytest.raises(UsageError, match=r"context_from_aux=3: data.aux_layer_ids has 3 layers"):
        draft_state.init_draft(config, target, mesh1, lambda path, shape: np.zeros(shape))


def test_the_copied_mask_marks_what_the_target_layers_and_the_context_start_from():
    """`copied_mask` (for `train.copied_lr_scale`): the 27 layer tensors `from_target_layers` copies and, with
    `context_from_aux`, `aux_proj` and `aux_norm`; nothing without `from_target_layers`."""
    config, target = _smoke()
    _, params, _ = draft_state.abstract_draft(config, target)
    assert draft_state.copied_mask(config, target) is None
    with config.unlocked():
        config.init.from_target_layers = (0, 2, -1)
    marked = lambda: {
        jax.tree_util.keystr(path)
        for path, m in jax.tree_util.tree_leaves_with_path(draft_state.copied_mask(config, target)(params))
        if m
    }
    layers = marked()
    assert len(layers) == 3 * 9 and all(k.startswith("['layers']") for k in layers)
    with config.unlocked():
        config.init.context_from_aux = -1
    assert marked() - layers == {"['aux_proj']['kernel'].value", "['aux_norm']['scale'].value"}
