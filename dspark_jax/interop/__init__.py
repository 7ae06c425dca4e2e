"""DeepSpec interoperability: its cache layout (`deepspec_cache`), its draft parameter layout
(`deepspec_layout`) and checkpoint export/import (`deepspec_checkpoint`)."""
