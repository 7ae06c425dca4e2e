"""`python -m dspark_jax.train`: the training command (`dspark_jax.cli.train`); training itself is in
`dspark_jax.training`."""
