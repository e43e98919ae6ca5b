"""What `partq status` and `partq dlq list` print of keys and etcd names holding terminal
escape sequences: escaped, never raw. The servers are replaced by fixed reports."""

from __future__ import annotations

from typing import Any

import pytest
from partq.coordinator.ops import dlq
from partq.coordinator.ops.deadletters import DeadLetter, Read
from partq.coordinator.store.codec import Parked
from partq.producer.contract import StreamSpec, key_id

import partq.cli.dlq
import partq.cli.operate
from partq.cli import main
from partq.cli.context import Context

EVIL = "\x1b]0;pwned\x07\x1b[2J"
SHOWN = r"\x1b]0;pwned\x07\x1b[2J"


class _Registry:
    def read_spec(self, stream: str) -> StreamSpec:
        return StreamSpec(stream, 2)


@pytest.fixture(autouse=True)
def no_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Context, "registry", lambda self: _Registry())


def _report() -> dict[str, Any]:
    return {
        "partitions": 2,
        "queue_type": "quorum",
        "leader": None,
        "members": [
            {
                "id": "a",
                "weight": 1,
                "age_s": 1.0,
                "owns": 2,
                "host": f"h{EVIL}",
                "pid": 1,
                "draining": True,
                "leaving": False,
            },
        ],
        "unassigned": [],
        "in_motion": [],
        "paused": [],
        "parked": [{"key": f"k{EVIL}"}],
        "rows": [],
        "malformed": [
            {
                "key": f"/partq/v1/streams/s/members/{EVIL}",
                "kind": "member",
                "error": "bad",
                "revision": 3,
            }
        ],
    }


def test_status_escapes_keys_hosts_and_etcd_names(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a report whose parked key, member host and a malformed etcd key hold escapes
    monkeypatch.setattr(partq.cli.operate, "snapshot_status", lambda *_a, **_k: _report())
    # When status prints it
    assert main(["status", "s"]) == 0
    out = capsys.readouterr().out
    # Then no escape character reaches the terminal, each is shown escaped
    assert "\x1b" not in out and "\x07" not in out
    assert out.count(SHOWN) == 3
    # And the drained member is marked, with how to undo it
    assert " DRAINED" in out and "undo: partq drain s MEMBER --cancel" in out


def test_dlq_list_escapes_parked_keys_and_errors(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a parked key and its error holding escapes
    record = Parked(key_id(f"k{EVIL}"), 0, f"ValueError: {EVIL}", "ValueError", "m1", "c1", 1.0)
    found = [dlq.ParkedKey(record, "q", 1)]
    monkeypatch.setattr(partq.cli.dlq.dlq, "parked_keys", lambda *_a, **_k: found)
    # And a dead letter whose key, member and error hold escapes
    letter = DeadLetter(0, f"k{EVIL}", 1, "ValueError", EVIL, 1, 1, f"c{EVIL}", "m2", 3, 0)
    read = Read(1, (letter,))
    monkeypatch.setattr(partq.cli.dlq.deadletters, "read", lambda *_a, **_k: read)
    # When dlq list and dlq show print them
    assert main(["dlq", "list", "s"]) == 0
    assert main(["dlq", "show", "s", "--key", f"k{EVIL}"]) == 0
    out = capsys.readouterr().out
    # Then the escapes are shown escaped
    assert "\x1b" not in out and "\x07" not in out
    assert out.count(SHOWN) >= 7
    # And the error is Python's line for it, its type named once
    assert "ValueError: ValueError" not in out


def test_dlq_show_names_an_error_type_once_and_no_absent_redrive_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a parked key whose redrive never failed, and its dead letter whose error line is
    # Python's own ("ValueError: poison key", as a consumer writes it)
    record = Parked(key_id("k"), 0, "ValueError: poison key", "ValueError", "m1", "c1", 1.0)
    found = [dlq.ParkedKey(record, "q", 1)]
    monkeypatch.setattr(partq.cli.dlq.dlq, "parked_keys", lambda *_a, **_k: found)
    letter = DeadLetter(0, "k", 1, "ValueError", "ValueError: poison key", 1, 1, "c1", "m2", 3, 0)
    monkeypatch.setattr(partq.cli.dlq.deadletters, "read", lambda *_a, **_k: Read(1, (letter,)))
    # When dlq show prints the key
    assert main(["dlq", "show", "s", "--key", "k"]) == 0
    out = capsys.readouterr().out
    # Then the error's type is named once, and nothing is said of a redrive error
    assert "ValueError: poison key" in out and "ValueError: ValueError" not in out
    assert "redrive_error" not in out and "None" not in out
