"""Interoperability: DeepSpec's cache layout (`deepspec_cache`) and draft parameter layout
(`deepspec_layout`), and what the serving engines read from an exported draft (`engines`: their side
files and a loader checker). Checkpoint export/import: `dspark_jax.run.deepspec_checkpoint`."""
