"""`python -m dspark_jax.experiments`: runs the command `dspark_jax.cli.suite`."""

from absl import flags

from dspark_jax.cli import suite

__doc__ = suite.__doc__  # absl's --help prints the main module's docstring and key flags
flags.adopt_module_key_flags(suite)

if __name__ == "__main__":
    suite.launch()
