"""`python -m dspark_jax.build_cache`: runs the command `dspark_jax.cli.build_cache`."""

from absl import flags

from dspark_jax.cli import build_cache

__doc__ = build_cache.__doc__  # absl's --help prints the main module's docstring and key flags
flags.adopt_module_key_flags(build_cache)

if __name__ == "__main__":
    build_cache.launch()
