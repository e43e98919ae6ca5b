"""The per-key dispatcher: random arrivals and completions, with a bounded pool behind it."""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st
from partq.consumers.state.keyorder import KeyQueues

# an operation: ("arrive", key) | ("run", _) a pool slot takes the oldest started item |
# ("finish", i) the i-th running item (mod how many run) finishes
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.integers(0, 5)),
        st.tuples(st.just("run"), st.just(0)),
        st.tuples(st.just("finish"), st.integers(0, 20)),
    ),
    max_size=200,
)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, slots=st.integers(1, 4))
def test_a_key_never_runs_twice_at_once_runs_in_order_and_nothing_is_lost(
    ops: list[tuple[str, int]], slots: int
) -> None:
    keys: KeyQueues[tuple[int, int]] = KeyQueues()
    arrived: dict[int, list[int]] = {}
    started: dict[int, list[int]] = {}
    pool: deque[tuple[int, int]] = deque()  # handed to the pool, no slot yet
    running: list[tuple[int, int]] = []
    seq = 0

    def start(item: tuple[int, int] | None) -> None:
        if item is not None:
            started.setdefault(item[0], []).append(item[1])
            pool.append(item)

    def finish(index: int) -> None:
        key, _ = running.pop(index % len(running))
        start(keys.done(key))

    for op, value in ops:
        if op == "arrive":
            seq += 1
            arrived.setdefault(value, []).append(seq)
            start(keys.arrive(value, (value, seq), float(seq)))
        elif op == "run" and pool and len(running) < slots:
            running.append(pool.popleft())
        elif op == "finish" and running:
            finish(value)
        held = [k for k, _ in running] + [k for k, _ in pool]
        assert len(held) == len(set(held))  # a key has one message in the pool or a handler
        assert len(running) <= slots
        assert keys.running == len(held)
    # drain: everything arrived is started once, in arrival order per key
    for _ in range(10 * seq + 10):
        if pool and len(running) < slots:
            running.append(pool.popleft())
        elif running:
            finish(0)
    assert not pool and not running and keys.running == 0 and keys.waiting == 0
    assert started == arrived


def test_a_key_is_forgotten_once_its_last_message_is_done() -> None:
    keys: KeyQueues[str] = KeyQueues()
    for i in range(1000):  # many distinct keys pass: none is kept
        assert keys.arrive(i, f"m{i}", 0.0) == f"m{i}"
        assert keys.done(i) is None
    assert keys.running == 0 and keys._keys == {}


def test_take_waiting_and_the_longest_wait() -> None:
    keys: KeyQueues[str] = KeyQueues()
    assert keys.arrive("a", "a1", 1.0) == "a1"
    assert keys.arrive("a", "a2", 2.0) is None
    assert keys.arrive("b", "b1", 3.0) == "b1"
    assert keys.arrive("b", "b2", 4.0) is None
    assert keys.longest_wait(10.0) == 8.0
    assert keys.take_waiting() == ["a2", "b2"]
    assert keys.waiting == 0 and keys.longest_wait(10.0) == 0.0
    assert keys.done("a") is None and keys.done("b") is None and keys.running == 0


class _Member:
    """A member's dispatch as ``partq.consumers.handling.keyed`` and
    ``partq.consumers.handling.runners`` do it, in
    simulated time: per partition a broker queue, a prefetch window of ``window``
    delivered-unacked messages and a :class:`KeyQueues`; one FIFO pool of ``threads``
    slots shared by all partitions; each handler call takes at most ``work``."""

    def __init__(self, queues: list[list[int]], window: int, threads: int) -> None:
        self.queues = [deque(enumerate(q)) for q in queues]  # (seq, key) not yet delivered
        self.window, self.threads = window, threads
        self.keys: list[KeyQueues[tuple[int, int, int]]] = [KeyQueues() for _ in queues]
        self.held = [0] * len(queues)  # delivered, not yet acked
        self.pool: deque[tuple[int, int, int]] = deque()  # (partition, seq, key)
        self.ends: list[tuple[float, int, int, int]] = []  # heap: (end, partition, seq, key)
        self.delivered: dict[tuple[int, int], tuple[float, int]] = {}  # -> (at, ahead)
        self.of_key: dict[tuple[int, int], int] = {}  # (partition, key) -> messages held
        self.waits: list[tuple[float, int]] = []  # (delivery to start, key's ahead)
        self.most_keys = 0  # most keys with a message held, over the member

    def deliver(self, now: float) -> None:
        for p, q in enumerate(self.queues):
            while q and self.held[p] < self.window:
                seq, key = q.popleft()
                self.held[p] += 1
                ahead = self.of_key.get((p, key), 0)
                self.of_key[(p, key)] = ahead + 1
                self.delivered[(p, seq)] = (now, ahead)
                started = self.keys[p].arrive(key, (p, seq, key), now)
                if started is not None:
                    self.pool.append(started)
        self.most_keys = max(self.most_keys, sum(k.running for k in self.keys))

    def run(self, now: float, work: Callable[[], float]) -> None:
        while self.pool and len(self.ends) < self.threads:
            p, seq, key = self.pool.popleft()
            at, ahead = self.delivered.pop((p, seq))
            self.waits.append((now - at, ahead))
            heapq.heappush(self.ends, (now + work(), p, seq, key))

    def finish(self) -> float:
        end, p, _seq, key = heapq.heappop(self.ends)
        self.held[p] -= 1  # acked
        self.of_key[(p, key)] -= 1
        started = self.keys[p].done(key)
        if started is not None:
            self.pool.append(started)  # to the pool's tail: FIFO among all running keys
        return end


def _zipf(rng: random.Random, keys: int, n: int, s: float = 1.1) -> list[int]:
    return rng.choices(range(keys), weights=[1 / (k + 1) ** s for k in range(keys)], k=n)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    partitions=st.integers(1, 6),
    window=st.integers(1, 40),
    threads=st.integers(1, 64),
)
def test_under_zipf_keys_every_message_starts_within_the_stated_bound(
    seed: int, partitions: int, window: int, threads: int
) -> None:
    # Given a member owning P partitions of Zipf(1.1) keys (the hottest about 1 in 6),
    # a prefetch window W per partition, N pool threads, handler calls of at most 1 s
    rng = random.Random(seed)
    queues = [_zipf(rng, 1000, 300) for _ in range(partitions)]
    member = _Member(queues, window, threads)
    now = 0.0
    # When everything is delivered and handled, as fast as the handlers go
    for _ in range(10 * partitions * 300 + 10):
        member.deliver(now)
        member.run(now, lambda: rng.uniform(0.5, 1.0))
        if not member.ends:
            break
        now = member.finish()
    # Then every message ran (nothing starves), and each started within
    # (k + 1) * ceil(R / N) s of its delivery, k: messages of its key held ahead of it,
    # R: keys with a message held (R <= P * W): at most W * ceil(P * W / N) s
    assert len(member.waits) == partitions * 300
    rounds = math.ceil(member.most_keys / threads)
    assert member.most_keys <= partitions * window
    for wait, ahead in member.waits:
        assert ahead < window
        assert wait <= (ahead + 1) * rounds + 1e-9, (wait, ahead, rounds)
    assert max(w for w, _ in member.waits) <= window * math.ceil(partitions * window / threads)


def test_the_longest_waiting_key_is_the_one_with_the_oldest_waiting_item() -> None:
    keys: KeyQueues[str] = KeyQueues()
    assert keys.longest_waiting(5.0) is None
    keys.arrive("a", "a1", 1.0)
    keys.arrive("b", "b1", 1.5)
    keys.arrive("b", "b2", 2.0)  # waits from 2.0
    keys.arrive("a", "a2", 3.0)  # waits from 3.0
    assert keys.longest_waiting(10.0) == ("b", 8.0)
    keys.done("b")  # b2 runs: a2 is the one waiting now
    assert keys.longest_waiting(10.0) == ("a", 7.0)
