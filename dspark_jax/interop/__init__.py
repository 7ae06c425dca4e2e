"""Interoperability: DeepSpec's cache layout (`deepspec_cache`) and draft parameter layout
(`deepspec_layout`), and the consumers of an exported draft (`consumers`: one module per serving engine or
trainer, each with the rules of its loader, and the engines' side files). Checkpoint export/import:
`dspark_jax.run.deepspec_checkpoint`."""
