"""The three tiers of a parametrized sweep (every group, schedule or size a check could run on):

  default run    a representative few (`pytest`, the README's test command);
  `slow`         heavier cases CI runs after the default run (`pytest -m slow`);
  `extended`     the rest of the sweep, also marked slow (`pytest -m extended`; CI leaves them out: 90
                 minutes on 2 cores do not hold every group x schedule of every end-to-end check).

Run `pytest -m "slow or extended"` (or `-m extended` alone) before changing what a sweep covers."""

import pytest

EXTENDED = (pytest.mark.slow, pytest.mark.extended)


def tiered(cases, fast=(), slow=()):
    """`cases` (tuples or single values) as parameters: those in `fast` unmarked, those in `slow` marked slow,
    every other one extended."""

    def param(case):
        values = case if isinstance(case, tuple) else (case,)
        if case in fast:
            return pytest.param(*values)
        return pytest.param(*values, marks=pytest.mark.slow if case in slow else EXTENDED)

    return [param(case) for case in cases]
