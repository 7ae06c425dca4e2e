"""Experiment suites: every group of a suite trained, calibrated and decoded under one protocol, and the
report that compares them (`python -m dspark_jax.experiments --suite=seed --preset=demo`).

`plan` says what runs, `runner` runs it resumably, `report` writes the table and plots.
"""
