"""What a suite runs: groups and their dependencies, overrides applied per group, bad input refused."""

import dataclasses

import pytest

from dspark_jax.errors import UsageError
from dspark_jax.suite import plan
from dspark_jax.suite.runner import SuiteRun


def test_the_seed_suite_holds_the_seven_groups_and_the_frozen_reranker_starts_from_the_baseline():
    names = [g.name for g in plan.groups("seed")]
    assert names == [
        "baseline",
        "engram_markov",
        "engram_mask_gated",
        "engram_mask_replace",
        "memory",
        "reranker_joint",
        "reranker_frozen",
        "baseline_same_budget",
    ]
    chain = ["baseline", "reranker_frozen", "baseline_same_budget"]
    assert [g.name for g in plan.groups("seed", ["reranker_frozen"])] == chain
    assert [g.name for g in plan.groups("seed", ["baseline_same_budget"])] == chain
    assert [g.name for g in plan.groups("seed", ["memory"])] == ["memory"]
    same = plan.groups("seed")[-1]
    assert (same.module, same.continues, same.budget_of) == ("baseline", "baseline", "reranker_frozen")


def test_every_group_trains_the_budget_and_the_same_budget_row_continues_the_baseline_to_twice_it(tmp_path):
    """Smoke: a budget of 3 of the 6-step schedule; the frozen reranker starts from the baseline's step 3 and
    trains 3 more; the same-budget baseline runs on the baseline's schedule to step 6. A budget whose double
    passes the schedule is refused before any work, naming the largest that fits."""
    suite = SuiteRun("seed", "smoke", str(tmp_path / "work"))
    stops = {name: c.train.stop_step for name, c in suite.configs.items()}
    assert stops == {**{g.name: 3 for g in suite.groups}, "baseline_same_budget": 6}
    frozen = suite.configs["reranker_frozen"]
    assert (frozen.init.step, frozen.init.checkpoint) == (3, str(tmp_path / "work" / "baseline"))
    same, base = suite.configs["baseline_same_budget"], suite.configs["baseline"]
    assert same.train.total_steps == base.train.total_steps == 6 and same.experiment == "baseline"
    wide = dataclasses.replace(plan.PROTOCOLS["smoke"], budget=4)
    with pytest.raises(UsageError, match=r"to step 8, past .* train.total_steps=6; give --budget=3"):
        SuiteRun("seed", "smoke", str(tmp_path / "other"), protocol=wide)


def test_overrides_apply_to_every_group_that_has_the_key():
    overrides = ["train.log_every=1", "engram.fit_limit=2", "data.cache_dir=/tmp/c", "data.pack=true"]
    plan.check_overrides(plan.groups("seed"), "smoke", overrides)
    base = plan.group_config(plan.groups("seed")[0], "smoke", overrides)
    engram = plan.group_config(plan.groups("seed")[1], "smoke", overrides)
    assert base.train.log_every == engram.train.log_every == 1
    assert base.data.cache_dir == "/tmp/c" and base.data.pack is True
    assert engram.engram.fit_limit == 2 and "engram" not in base


def test_settings_parse_in_order():
    assert plan.parse_settings(["0:fixed", "1:confidence"]) == ((0.0, "fixed"), (1.0, "confidence"))
    assert plan.parse_settings([f"{t:g}:{s}" for t, s in plan.ALL_SETTINGS]) == plan.ALL_SETTINGS


def test_command_line_names_every_flag_that_differs_from_the_preset():
    protocol = {"limit": 16, "max_new_tokens": 96, "concurrency": 1, "settings": plan.ALL_SETTINGS}
    record = {
        "suite": "seed",
        "preset": "demo",
        "groups": [g.name for g in plan.groups("seed")],
        "overrides": [],
        "protocol": protocol,
    }
    assert plan.command_line(record) == "python -m dspark_jax.experiments --suite=seed --preset=demo"
    record |= {
        "groups": ["baseline", "memory"],
        "overrides": ["train.stop_step=160"],
        "protocol": protocol | {"limit": 4, "settings": [[0, "fixed"], [1, "confidence"]]},
    }
    assert plan.command_line(record) == (
        "python -m dspark_jax.experiments --suite=seed --preset=demo --groups=baseline,memory"
        " --override=train.stop_step=160 --limit=4 --settings=0:fixed,1:confidence"
    )
    seeded = [g.name for g in plan.with_seeds(plan.groups("seed", ["reranker_frozen"]), 2)]
    record |= {"groups": seeded, "overrides": [], "protocol": protocol | {"seeds": 2}}
    assert plan.command_line(record) == (
        "python -m dspark_jax.experiments --suite=seed --preset=demo --groups=baseline,reranker_frozen"
        " --seeds=2"
    )


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: plan.groups("nope"), "is not a suite"),
        (lambda: plan.groups("seed", ["baseline", "nope"]), "'nope' is not in suite 'seed'"),
        (
            lambda: plan.check_overrides(plan.groups("seed"), "smoke", ["train.stop_step"]),
            "expected KEY=VALUE",
        ),
        (
            lambda: plan.check_overrides(plan.groups("seed"), "smoke", ["train.stop_step=3"]),
            "the suite's step budget is --budget=N",
        ),
        (
            lambda: plan.check_overrides(plan.groups("seed"), "smoke", ["train.nope=1"]),
            "not a key of any group",
        ),
        (
            lambda: plan.group_config(plan.groups("seed")[0], "smoke", ["train.stop_step=abc"]),
            "train.stop_step=abc",
        ),
        (lambda: plan.group_config(plan.groups("seed")[0], "smoke", ["data.pack=maybe"]), "true or false"),
        (lambda: plan.parse_settings(["0:greedy"]), "'0:greedy': expected TEMPERATURE:SCHEDULE"),
        (lambda: plan.parse_settings(["hot:fixed"]), "'hot:fixed'"),
        (lambda: plan.parse_settings(["-1:fixed"]), "temperature >= 0"),
    ],
)
def test_bad_suite_input_is_one_clear_error(call, message):
    with pytest.raises(UsageError, match=message):
        call()


def test_seeds_repeat_every_row_with_another_train_seed_and_their_own_sources(tmp_path):
    """`--seeds=2` on the frozen reranker's chain: each row again with train.seed = seed + 1, the seed row of
    the frozen reranker starting from the seed row of the baseline; caches, target and validation batches
    keep `seed`."""
    protocol = dataclasses.replace(plan.PROTOCOLS["smoke"], seeds=2)
    suite = SuiteRun("seed", "smoke", str(tmp_path), names=["reranker_frozen"], protocol=protocol)
    names = [g.name for g in suite.groups]
    assert names == [
        "baseline",
        "reranker_frozen",
        "baseline_same_budget",
        "baseline_seed1",
        "reranker_frozen_seed1",
        "baseline_same_budget_seed1",
    ]
    c = suite.configs
    assert c["baseline"].train.seed is None and c["baseline_seed1"].train.seed == c["baseline"].seed + 1
    assert c["baseline_seed1"].seed == c["baseline"].seed  # the caches, the target, the validation batches
    assert c["reranker_frozen_seed1"].init.checkpoint == str(tmp_path / "baseline_seed1")
    assert c["baseline_same_budget_seed1"].train.stop_step == 6
    assert suite.record["protocol"]["seeds"] == 2
    with pytest.raises(UsageError, match="--seeds=0"):
        SuiteRun("seed", "smoke", str(tmp_path), protocol=dataclasses.replace(protocol, seeds=0))
