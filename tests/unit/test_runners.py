"""The handler event loop outlives what an ``async def`` handler raises (issue 43, item 9)."""

from __future__ import annotations

import threading
from collections.abc import Awaitable
from typing import Any

import pytest
from partq.consumers.handling.runners import EventLoop


async def _raises(error: BaseException) -> None:
    raise error


async def _returns(value: int) -> int:
    return value


def _wait(loop: EventLoop, awaitable: Awaitable[Any]) -> object:
    """What ``loop.wait`` returned or raised, from a daemon thread, within 5 s."""
    outcome: list[object] = []

    def call() -> None:
        try:
            outcome.append(loop.wait(awaitable))
        except BaseException as error:  # the outcome under test
            outcome.append(error)

    caller = threading.Thread(target=call, daemon=True)  # a hung wait must not hang pytest
    caller.start()
    caller.join(timeout=5)
    assert outcome, "the handler event loop never answered"
    return outcome[0]


@pytest.mark.parametrize("error", [SystemExit(7), KeyboardInterrupt()], ids=["exit", "interrupt"])
def test_an_async_handler_exiting_fails_its_call_and_the_loop_goes_on(
    error: BaseException,
) -> None:
    # Given the member's handler event loop
    loop = EventLoop(name="test-handler-loop")
    try:
        # When a coroutine raises SystemExit / KeyboardInterrupt
        # Then the calling thread gets that very exception at once (its message's failed
        # attempt), not a wait until --handler-timeout on a loop that died
        assert _wait(loop, _raises(error)) is error
        # And the loop still runs the next message's coroutine
        assert _wait(loop, _returns(3)) == 3
    finally:
        loop.close()
