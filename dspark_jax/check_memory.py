"""`python -m dspark_jax.check_memory`: runs the command `dspark_jax.cli.check_memory`."""

from absl import flags

from dspark_jax.cli import check_memory

__doc__ = check_memory.__doc__  # absl's --help prints the main module's docstring and key flags
flags.adopt_module_key_flags(check_memory)

if __name__ == "__main__":
    check_memory.launch()
