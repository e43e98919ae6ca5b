"""PublishFuture behaves as a concurrent.futures.Future, though it makes its condition late."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
from partq.producer.futures import PublishFuture, resolve_all


def test_an_outcome_stored_before_anyone_waits_is_seen() -> None:
    done: PublishFuture[int] = PublishFuture()
    done.set_result(7)
    assert done.done() and done.result(timeout=0) == 7
    seen: list[int] = []
    done.add_done_callback(lambda f: seen.append(f.result()))
    assert seen == [7]
    failed: PublishFuture[int] = PublishFuture()
    failed.set_exception(ValueError("no"))
    with pytest.raises(ValueError, match="no"):
        failed.result(timeout=0)
    with pytest.raises(concurrent.futures.InvalidStateError):
        done.set_result(8)
    assert not done.cancel()


def test_waiters_and_callbacks_that_came_first_are_woken() -> None:
    pending: PublishFuture[int] = PublishFuture()
    seen: list[int] = []
    pending.add_done_callback(lambda f: seen.append(f.result()))
    with pytest.raises(concurrent.futures.TimeoutError):
        pending.result(timeout=0.01)
    pending.set_result(3)
    assert seen == [3] and pending.result(timeout=0) == 3
    others = [PublishFuture[int]() for _ in range(3)]
    for i, f in enumerate(others):
        f.set_result(i)
    assert [f.result() for f in concurrent.futures.as_completed(others, timeout=1)]


def test_a_waiter_racing_the_resolver_never_misses_the_outcome() -> None:
    # Given many futures, each resolved by one thread while another starts waiting on it
    for i in range(2000):
        future: PublishFuture[int] = PublishFuture()
        got: list[int] = []
        waiter = threading.Thread(target=lambda f=future, g=got: g.append(f.result(timeout=5)))
        waiter.start()
        future.set_result(i)
        waiter.join(10)
        # Then every waiter got its result (none timed out, none hangs)
        assert got == [i]


def test_resolve_all_settles_untouched_and_waited_on_futures_alike() -> None:
    # Given futures nobody touched, one with a waiter, one with a callback
    quiet = [PublishFuture[int]() for _ in range(3)]
    waited: PublishFuture[int] = PublishFuture()
    called: PublishFuture[int] = PublishFuture()
    seen: list[int] = []
    called.add_done_callback(lambda f: seen.append(f.result()))
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(waited.result(timeout=5)))
    waiter.start()
    # When they are resolved together
    resolve_all([(f, i) for i, f in enumerate([*quiet, waited, called])])
    waiter.join(5)
    # Then each has its own result, the waiter woke and the callback ran
    assert [f.result(timeout=0) for f in quiet] == [0, 1, 2]
    assert got == [3] and seen == [4]
    assert all(f.done() and f.exception(timeout=0) is None for f in [*quiet, waited, called])
    # And a settled future is never settled twice
    with pytest.raises(concurrent.futures.InvalidStateError):
        resolve_all([(quiet[0], 9)])
    assert quiet[0].result() == 0


def test_a_settled_future_is_read_without_making_its_condition() -> None:
    done: PublishFuture[int] = PublishFuture()
    failed: PublishFuture[int] = PublishFuture()
    resolve_all([(done, 1)])
    failed.set_exception(KeyError("k"))
    assert done.done() and done.result() == 1 and done.exception() is None
    assert failed.done() and isinstance(failed.exception(), KeyError)
    with pytest.raises(KeyError):
        failed.result()
    assert "_condition" not in done.__dict__ and "_condition" not in failed.__dict__
    pending: PublishFuture[int] = PublishFuture()
    assert not pending.done()
