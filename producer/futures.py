"""The future a publish returns: a ``concurrent.futures.Future`` that is cheap to make.

A ``Future`` makes a ``threading.Condition`` (an ``RLock`` and a ``Condition``) when it is
built, about a fifth of the SDK's own CPU per message, though most publishes are never
waited on one by one. :class:`PublishFuture` makes it only when someone waits, adds a
callback or resolves a future that has one; resolving one that nobody has touched just
stores the outcome. One module lock orders the two, so a waiter either makes the
condition before the outcome is stored (and is notified) or finds the outcome stored.
:func:`resolve_all` settles a confirm frame's futures under that lock once, and
``done``/``result``/``exception`` on a settled future read the outcome without making
the condition (the outcome is stored before the state says FINISHED).
It relies on ``concurrent.futures.Future``'s attributes as of Python 3.11 (``_state``,
``_result``, ``_exception``); ``tests/unit/test_futures.py`` pins the behaviour.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from concurrent.futures._base import FINISHED, PENDING
from typing import Any, TypeVar

__all__ = ["PublishFuture", "resolve_all"]

T = TypeVar("T")
_MAKING = threading.Lock()


class PublishFuture(Future[T]):
    """A publish cannot be taken back once handed over, so it cannot be cancelled."""

    def __init__(self) -> None:  # everything Future.__init__ sets, but the condition
        self._state = PENDING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._waiters: list[Any] = []
        self._done_callbacks: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        if name != "_condition":
            raise AttributeError(name)
        with _MAKING:
            condition = self.__dict__.get("_condition")
            if condition is None:
                condition = self.__dict__["_condition"] = threading.Condition()
        return condition

    def cancel(self) -> bool:
        return False

    def done(self) -> bool:
        return self._state == FINISHED  # never cancelled: done is finished

    def result(self, timeout: float | None = None) -> T:
        if self._state == FINISHED:  # settled: no condition needed
            if self._exception is not None:
                raise self._exception
            return self._result  # type: ignore[no-any-return]
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if self._state == FINISHED:
            return self._exception
        return super().exception(timeout)

    def set_result(self, result: T) -> None:
        if not self._stored(result=result):
            super().set_result(result)

    def set_exception(self, exception: BaseException | None) -> None:
        if not self._stored(exception=exception):
            super().set_exception(exception)

    def _stored(self, **outcome: Any) -> bool:
        """Store the outcome (``result`` or ``exception``) if nobody has made the condition
        yet (nobody waits, no callback): True if done, False to go through Future's path."""
        with _MAKING:
            if "_condition" in self.__dict__:
                return False
            if self._state != PENDING:
                raise InvalidStateError(f"{self._state}: {self!r}")
            for name, value in outcome.items():
                setattr(self, f"_{name}", value)
            self._state = FINISHED
            return True


def resolve_all(outcomes: Sequence[tuple[PublishFuture[T], T]]) -> None:
    """``future.set_result(result)`` for each pair, taking the module lock once for all the
    futures nobody has touched (the others go through ``Future``'s path, one by one)."""
    touched = []
    with _MAKING:
        for future, result in outcomes:
            if "_condition" in future.__dict__ or future._state != PENDING:
                touched.append((future, result))
                continue
            future._result = result
            future._state = FINISHED
    for future, result in touched:
        Future.set_result(future, result)  # notifies waiters, runs callbacks
