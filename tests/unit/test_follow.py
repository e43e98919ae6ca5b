"""partq.producer.follow.SpecFollower: how a producer learns a newer layout (docs/resize.md)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

from partq.producer.contract import StreamSpec
from partq.producer.follow import SpecFollower

from partq.kernel.errors import EtcdUnavailable

OLD = StreamSpec("orders", 8)
NEW = replace(StreamSpec("orders", 16), epoch=1)


class _Etcd:
    """What a follower reads: the spec etcd holds (or the error reading it raises), and
    the watch's callback, called only when a test pushes."""

    def __init__(self, spec: StreamSpec | EtcdUnavailable) -> None:
        self.now = spec
        self.reads = 0
        self.on_spec: Callable[[StreamSpec | None], None] | None = None

    def read_spec(self, stream: str) -> StreamSpec:
        self.reads += 1
        if isinstance(self.now, EtcdUnavailable):
            raise self.now
        return self.now

    def watch_spec(self, stream: str, on_spec: Callable[[StreamSpec | None], None]) -> int:
        self.on_spec = on_spec
        return 1

    def cancel_watch(self, watch_id: int) -> None:
        self.on_spec = None

    def read_resize(self, stream: str) -> bytes | None:
        return None


def test_a_stale_spec_finds_the_newer_layout_at_once_even_without_waiting() -> None:
    # Given a follower given a spec that etcd has replaced, and no push of it
    etcd = _Etcd(NEW)
    seen: list[StreamSpec] = []
    follower = SpecFollower(etcd, OLD, seen.append)
    # When it asks for a newer layout, with no time to wait
    found = follower.wait_newer(OLD.epoch, 0)
    # Then it read etcd first and has it
    assert found == NEW == follower.spec
    assert seen == [NEW]


def test_without_a_newer_layout_the_wait_ends_at_its_timeout_reading_each_second() -> None:
    etcd = _Etcd(OLD)
    follower = SpecFollower(etcd, OLD, lambda spec: None)
    started = time.monotonic()
    assert follower.wait_newer(OLD.epoch, 1.5) is None
    assert time.monotonic() - started >= 1.5
    assert etcd.reads >= 2  # at once, then after 1 s (and at the end)
    etcd.now = EtcdUnavailable("etcd at 127.0.0.1:1 is unavailable")
    assert follower.wait_newer(OLD.epoch, 0) is None  # etcd away: no layout, no error


def test_a_pushed_layout_ends_the_wait() -> None:
    etcd = _Etcd(OLD)  # reading etcd never gives the newer layout: only the push does
    follower = SpecFollower(etcd, OLD, lambda spec: None)
    assert etcd.on_spec is not None
    push = threading.Timer(0.2, etcd.on_spec, (NEW,))
    push.start()
    assert follower.wait_newer(OLD.epoch, 30) == NEW
    push.join()
    follower.close()
    assert etcd.on_spec is None
