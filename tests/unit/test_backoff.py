"""partq.kernel.backoff: the one exponential backoff."""

from __future__ import annotations

import pytest

from partq.kernel.backoff import Backoff


def test_the_default_waits_0_2_s_doubling_to_5_s() -> None:
    delays = Backoff().delays()
    assert [delays.next() for _ in range(8)] == pytest.approx(
        [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0]
    )
    assert delays.attempts == 8


def test_reset_starts_again_at_the_initial_delay() -> None:
    delays = Backoff(initial=0.1, maximum=2.0).delays()
    assert [delays.next() for _ in range(3)] == pytest.approx([0.1, 0.2, 0.4])
    delays.reset()
    assert delays.attempts == 0
    assert delays.next() == pytest.approx(0.1)


def test_each_loop_has_its_own_position() -> None:
    backoff = Backoff()
    first, second = backoff.delays(), backoff.delays()
    first.next()
    first.next()
    assert second.next() == pytest.approx(0.2)
    assert first.next() == pytest.approx(0.8)


def test_delay_counts_attempts_from_one() -> None:
    backoff = Backoff(initial=0.1, factor=3.0, maximum=1.0)
    assert [backoff.delay(n) for n in (1, 2, 3, 4)] == pytest.approx([0.1, 0.3, 0.9, 1.0])
    with pytest.raises(ValueError, match="from 1"):
        backoff.delay(0)


def test_an_initial_delay_over_the_maximum_is_capped() -> None:
    assert Backoff(initial=10.0, maximum=5.0).delay(1) == 5.0


def test_a_loop_retrying_for_hours_stays_at_the_maximum() -> None:
    assert Backoff().delay(100_000) == 5.0  # 2.0 ** 99_999 overflows a float


def test_a_factor_of_one_is_a_constant_delay() -> None:
    assert [Backoff(initial=0.5, factor=1.0).delay(n) for n in (1, 50)] == [0.5, 0.5]


@pytest.mark.parametrize(
    "arguments",
    [{"initial": -0.1}, {"maximum": -1.0}, {"factor": 0.5}],
)
def test_nonsense_is_refused(arguments: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Backoff(**arguments)


def test_the_policy_is_frozen() -> None:
    with pytest.raises(AttributeError):
        Backoff().initial = 1.0  # type: ignore[misc]
