"""`python -m dspark_jax.import_draft`: runs the command `dspark_jax.cli.import_draft`."""

from absl import flags

from dspark_jax.cli import import_draft

__doc__ = import_draft.__doc__  # absl's --help prints the main module's docstring and key flags
flags.adopt_module_key_flags(import_draft)

if __name__ == "__main__":
    import_draft.launch()
