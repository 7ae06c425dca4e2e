"""Assembling a run from a config: validation (`config_lib`), the target side (`target_side`), the caches
as grain sources (`sources`), the draft's state (`draft_state`), checkpoints and what a work directory
holds (`checkpoints`), the speculative decoder (`decoding`). Training, the commands, the suite and the
benchmarks all build their runs here."""
