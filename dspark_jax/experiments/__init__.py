"""`python -m dspark_jax.experiments --suite=seed`: runs an experiment suite (`dspark_jax.cli.suite`).

The groups themselves live in `dspark_jax.groups`."""
