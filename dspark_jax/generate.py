"""`python -m dspark_jax.generate`: runs the command `dspark_jax.cli.generate`."""

from absl import flags

from dspark_jax.cli import generate

__doc__ = generate.__doc__  # absl's --help prints the main module's docstring and key flags
flags.adopt_module_key_flags(generate)

if __name__ == "__main__":
    generate.launch()
