"""Tests for `dspark_jax.train`; a package, so basenames such as test_checkpoint.py may repeat elsewhere."""
