"""Draft Memory (two-stage): the memory draft (`model`) and its group (`group`)."""
