"""Logical-axis rules for tests that place drafts of several groups without a run config: the default
table plus every registered group's own rules (a run gets its group's: `run.config_lib.sharding_rules`)."""

from dspark_jax import groups, sharding

ALL_GROUPS = (
    *sharding.DEFAULT_RULES,
    *dict.fromkeys(rule for experiment in groups.registered() for rule in experiment.run.sharding_rules),
)
