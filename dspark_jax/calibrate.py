"""`python -m dspark_jax.calibrate`: runs the command `dspark_jax.cli.calibrate`."""

from absl import flags

from dspark_jax.cli import calibrate

__doc__ = calibrate.__doc__  # absl's --help prints the main module's docstring and key flags
flags.adopt_module_key_flags(calibrate)

if __name__ == "__main__":
    calibrate.launch()
