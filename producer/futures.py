"""The future a publish returns: a ``concurrent.futures.Future`` that is cheap to make.

A ``Future`` makes a ``threading.Condition`` (an ``RLock`` and a ``Condition``) when it is
built, about a fifth of the SDK's own CPU per message, though most publishes are never
waited on one by one. :class:`PublishFuture` makes it only when someone waits, adds a
callback or resolves a future that has one; resolving one that nobody has touched just
stores the outcome. One module lock orders the two, so a waiter either makes the
condition before the outcome is stored (and is notified) or finds the outcome stored.
It relies on ``concurrent.futures.Future``'s attributes as of Python 3.11 (``_state``,
``_result``, ``_exception``); ``tests/unit/test_futures.py`` pins the behaviour.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, InvalidStateError
from concurrent.futures._base import FINISHED, PENDING
from typing import Any, TypeVar

__all__ = ["PublishFuture"]

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
