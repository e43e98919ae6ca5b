"""AsyncProducer's checks that need no broker: its options, and use before open."""

from __future__ import annotations

import asyncio

import pytest
from partq.producer import AsyncProducer, StreamSpec, UsageError


def test_an_unknown_option_is_refused_when_made() -> None:
    # When an AsyncProducer is made with an option Producer does not take
    # Then it is refused at once (not later, in open), naming the option
    with pytest.raises(TypeError, match="windows"):
        AsyncProducer("orders", windows=10)
    # And the bridge's own hook cannot be replaced
    with pytest.raises(TypeError, match="on_settled"):
        AsyncProducer("orders", on_settled=print)


def test_use_before_open_says_how_to_open() -> None:
    producer = AsyncProducer(StreamSpec("orders", 4), window=10)

    async def main() -> None:
        # When it publishes, batches or flushes before being opened
        for attempt in (
            producer.publish("k", b"v"),
            producer.send_many([("k", b"v")]),
            producer.flush(),
        ):
            # Then each says how to open it
            with pytest.raises(UsageError, match=r"async with AsyncProducer\(\.\.\.\)"):
                await attempt
        # And closing a producer that was never opened does nothing
        await producer.close()

    asyncio.run(main())
    assert repr(producer) == "AsyncProducer(not open)"
