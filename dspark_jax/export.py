"""`python -m dspark_jax.export`: runs the command `dspark_jax.cli.export`."""

from absl import flags

from dspark_jax.cli import export

__doc__ = export.__doc__  # absl's --help prints the main module's docstring and key flags
flags.adopt_module_key_flags(export)

if __name__ == "__main__":
    export.launch()
