"""The prefix reranker, joint and frozen-baseline: its draft (`model`) and groups (`group`)."""
