"""`python -m dspark_jax.train`: runs the command `dspark_jax.cli.train`."""

from absl import flags

from dspark_jax.cli import train

__doc__ = train.__doc__  # absl's --help prints the main module's docstring and key flags
flags.adopt_module_key_flags(train)

if __name__ == "__main__":
    train.launch()
