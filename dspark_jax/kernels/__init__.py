"""Attention kernels of the draft: block attention over `[context; memory; block]` keys/values."""
