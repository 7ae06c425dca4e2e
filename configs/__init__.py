"""Experiment configs: `get_config(preset)` returns a locked ml_collections ConfigDict."""
