"""The per-key dispatcher: random arrivals and completions, with a bounded pool behind it."""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from consumers.keyorder import KeyQueues

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
