"""Handlers for the invariant tests' consumer processes.

``record`` is :func:`consumers.examples.record_handler` (one JSON line per handling
to ``$PARTQ_RECORD``); ``poison`` raises for bodies containing ``poison``;
``poison_key`` raises for ``$PARTQ_POISON_KEY``'s messages from seq
``$PARTQ_POISON_SEQ`` on while the file ``$PARTQ_POISON_FLAG`` exists (delete it to
"fix the handler"), and takes ``$PARTQ_POISON_SLOW`` seconds per message of that key.
"""

from __future__ import annotations

import json
import os
import time

from consumers.examples import record_handler as record
from consumers.message import Message

__all__ = ["poison", "poison_key", "record"]


def poison(message: Message) -> None:
    if b"poison" in message.body:
        raise ValueError(f"poison message {message.message_id}")
    record(message)


def poison_key(message: Message) -> None:
    key = message.key.decode() if isinstance(message.key, bytes) else message.key
    chosen = os.environ.get("PARTQ_POISON_KEY", "").split(",")  # one key, or several
    poisoned = key in chosen and os.path.exists(os.environ["PARTQ_POISON_FLAG"])
    if poisoned and json.loads(message.body)["seq"] >= int(os.environ["PARTQ_POISON_SEQ"]):
        raise ValueError(f"poisoned message {message.message_id}")
    if key in chosen:  # once fixed, slower: a replay takes time
        time.sleep(float(os.environ.get("PARTQ_POISON_SLOW", "0")))
    record(message)
