"""Training: the loop (`loop`), the compiled step (`step`), teacher-forced evaluation (`evaluation`), the
metrics writer, preemption, progress lines and the ahead-of-time memory check (`aot`, `topology`).
The command is `python -m dspark_jax.train` (`dspark_jax/train.py`)."""
