"""`python -m dspark_jax.evaluate`: runs the command `dspark_jax.cli.evaluate`."""

from absl import flags

from dspark_jax.cli import evaluate

__doc__ = evaluate.__doc__  # absl's --help prints the main module's docstring and key flags
flags.adopt_module_key_flags(evaluate)

if __name__ == "__main__":
    evaluate.launch()
