"""`python -m dspark_jax.fit_engram`: runs the command `dspark_jax.cli.fit_engram`."""

from absl import flags

from dspark_jax.cli import fit_engram

__doc__ = fit_engram.__doc__  # absl's --help prints the main module's docstring and key flags
flags.adopt_module_key_flags(fit_engram)

if __name__ == "__main__":
    fit_engram.launch()
