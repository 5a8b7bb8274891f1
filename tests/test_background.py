"""`BackgroundCalls`: calls made in order on their own thread, flushed, back-pressured, and
a failure raised on the caller's thread."""

from __future__ import annotations

import threading
import time

import pytest

from lab._background import BackgroundCalls


def test_calls_are_made_in_order_on_the_named_thread_and_flush_waits_for_them() -> None:
    made: list[tuple[int, str]] = []
    calls = BackgroundCalls("lab-test-sender", interval_s=60)  # only a flush wakes it
    for i in range(100):
        calls.call(lambda i=i: made.append((i, threading.current_thread().name)))
    assert made == [] and calls.pending == 100  # queued, not made on this thread
    calls.flush()
    assert made == [(i, "lab-test-sender") for i in range(100)]
    assert calls.pending == 0
    calls.call(made.append, (100, "last"))
    calls.close()  # close makes what is queued
    assert made[-1] == (100, "last")
    with pytest.raises(RuntimeError, match="after close"):
        calls.call(made.append, "too late")


def test_the_first_failure_is_raised_on_the_callers_thread_and_the_rest_goes_on() -> None:
    made: list[int] = []

    def fail(n: int) -> None:
        raise ValueError(f"service said no to {n}")

    calls = BackgroundCalls("lab-test-fail", interval_s=60)
    calls.call(made.append, 1)
    calls.call(fail, 2)
    calls.call(made.append, 3)
    with pytest.raises(ValueError, match="service said no to 2"):
        calls.flush()
    assert made == [1, 3]
    calls.flush()  # raised once, not again
    calls.call(fail, 4)
    with pytest.raises(ValueError, match="to 4"):
        calls.close()


def test_a_full_queue_makes_the_caller_wait_instead_of_dropping() -> None:
    made: list[int] = []
    most = [0]
    calls = BackgroundCalls("lab-test-full", interval_s=60, max_pending=5)

    def slow(i: int) -> None:
        time.sleep(0.001)
        made.append(i)

    for i in range(40):
        calls.call(slow, i)
        most[0] = max(most[0], calls.pending)
    calls.close()
    assert made == list(range(40))  # nothing dropped, in order
    assert most[0] <= 5
