"""partq.consumers.state.priority: the heir's consumer priority and where the broker switches
by it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from partq.consumers.state.priority import (
    MAX_PRIORITY,
    consume_arguments,
    heir_priority,
    inherits_claim,
    switches,
)
from partq.coordinator.store.codec import Claim


def test_no_priority_sends_no_argument() -> None:
    assert consume_arguments(None) is None


def test_a_priority_is_the_x_priority_argument() -> None:
    assert consume_arguments(7) == {"x-priority": 7}


@pytest.mark.parametrize("bad", [-1, MAX_PRIORITY + 1])
def test_a_priority_outside_a_signed_32_bit_int_is_refused_with_what_to_do(bad: int) -> None:
    with pytest.raises(ValueError, match="reset the partition's priority counter"):
        consume_arguments(bad)


@given(st.one_of(st.none(), st.integers(min_value=0, max_value=MAX_PRIORITY - 1)))
def test_the_heir_always_outranks_the_owner(owner: int | None) -> None:
    heir = heir_priority(owner)
    assert heir > (0 if owner is None else owner)  # None: RabbitMQ's default, 0
    assert consume_arguments(heir) == {"x-priority": heir}


@pytest.mark.parametrize(
    ("version", "queue_type", "expected"),
    [
        ("4.0.5", "quorum", True),  # measured: benchmarks/sac_priority.py
        ("4.1.0", "quorum", True),
        ("4.0.5", "classic", False),  # measured: a classic queue never switches
        ("3.10.8", "quorum", False),  # measured
        ("3.13.7", "quorum", False),  # QQ v4 (4.0) brought it; no 3.13.x has it
        ("", "quorum", False),
        ("unknown", "quorum", False),
    ],
)
def test_only_quorum_queues_of_rabbitmq_4_switch_by_priority(
    version: str, queue_type: str, expected: bool
) -> None:
    assert switches(version, queue_type) is expected


def test_an_heir_inherits_only_the_very_claim_it_subscribed_behind() -> None:
    claim = Claim("a", 7, priority=3)
    assert inherits_claim(claim, 40, "a", 40)
    assert not inherits_claim(claim, 41, "a", 40)  # rewritten since: sealed, or handed on
    assert not inherits_claim(claim, 40, "c", 40)  # another owner's
    assert not inherits_claim(Claim("a", 7, sealed=True), 40, "a", 40)
