"""PreemptionGuard: a signal sets the flag, a second one goes through, old handlers come back."""

import os
import signal

from dspark_jax.training.preemption import PreemptionGuard


def test_sigterm_sets_the_flag_and_handlers_are_restored():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    with PreemptionGuard() as guard:
        assert not guard.requested
        assert not guard.should_stop(0)
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.requested
        assert guard.should_stop(1)
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_second_signal_reaches_the_previous_handler():
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        with PreemptionGuard(signals=(signal.SIGINT,)) as guard:
            os.kill(os.getpid(), signal.SIGINT)
            assert guard.requested and received == []
            os.kill(os.getpid(), signal.SIGINT)
            assert received == [signal.SIGINT]
        os.kill(os.getpid(), signal.SIGINT)
        assert received == [signal.SIGINT, signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)
