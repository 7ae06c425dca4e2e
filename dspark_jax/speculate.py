"""`python -m dspark_jax.speculate`: runs the command `dspark_jax.cli.speculate`."""

from absl import flags

from dspark_jax.cli import speculate

__doc__ = speculate.__doc__  # absl's --help prints the main module's docstring and key flags
flags.adopt_module_key_flags(speculate)

if __name__ == "__main__":
    speculate.launch()
