"""bf16 rounding for numeric tests: exact rounding of fp32 values, and the distance between two bf16 arrays in
representable steps."""

import ml_dtypes
import numpy as np


def rounded(x) -> np.ndarray:
    """fp32 `x` rounded to bf16 (nearest, ties to even) and back to fp32."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def steps(got, want) -> np.ndarray:
    """The bf16 steps from `want` to `got` (both representable in bf16), elementwise: 0 where equal, 1 for
    neighbours. Bit patterns are mapped to ordered integers, so +0 and -0 are 0 apart and a pair on either
    side of zero counts the steps through it."""

    def ordered(x):
        bits = np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.int16).astype(np.int32)
        return np.where(bits < 0, -(bits & 0x7FFF), bits)

    for x in (got, want):
        x = np.asarray(x, np.float32)
        assert np.array_equal(rounded(x), x, equal_nan=True), "steps() takes values representable in bf16"
    return np.abs(ordered(got) - ordered(want))
