"""`python -m dspark_jax.regenerate`: runs the command `dspark_jax.cli.regenerate`."""

from absl import flags

from dspark_jax.cli import regenerate

__doc__ = regenerate.__doc__  # absl's --help prints the main module's docstring and key flags
flags.adopt_module_key_flags(regenerate)

if __name__ == "__main__":
    regenerate.launch()
