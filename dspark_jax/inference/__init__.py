"""Speculative decoding with a DSpark draft and the target: acceptance, cycles, the decoding loop."""
