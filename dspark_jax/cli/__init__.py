"""Every command: flag parsing and `main`, one module per command (`python -m dspark_jax.<command>` runs
the module of that name here); the shared plumbing (the `--config` flag, paths, errors) in `common`."""
