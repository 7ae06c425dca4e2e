"""`python -m dspark_jax.inspect_cache`: runs the command `dspark_jax.cli.inspect_cache`."""

from absl import flags

from dspark_jax.cli import inspect_cache

__doc__ = inspect_cache.__doc__  # absl's --help prints the main module's docstring and key flags
flags.adopt_module_key_flags(inspect_cache)

if __name__ == "__main__":
    inspect_cache.launch()
