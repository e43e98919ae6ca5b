"""Example handlers for the demo, docs and deploy manifests."""

from __future__ import annotations

from consumers.message import Message


def print_handler(message: Message) -> None:
    """Print each message; returning acks it."""
    key = message.key.decode(errors="replace") if isinstance(message.key, bytes) else message.key
    print(f"p{message.partition} key={key} id={message.message_id} {message.body[:80]!r}")


def noop_handler(message: Message) -> None:
    """Ack without doing anything (for throughput measurements)."""
