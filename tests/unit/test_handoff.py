"""The per-partition handoff state machine (pure)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import example, given, settings
from hypothesis import strategies as st
from partq.consumers.state.handoff import Command, Event, Holder, Phase, Standby, State, step


def run(events: list[Event], state: State | None = None) -> tuple[State, list[Command]]:
    state = state or State()
    issued: list[Command] = []
    for event in events:
        state, commands = step(state, event)
        issued.extend(commands)
    return state, issued


def test_planned_move_is_revoke_drain_release_then_nothing() -> None:
    # Given an active partition
    active, commands = run([Event.ASSIGNED, Event.CLAIMED, Event.SUBSCRIBED])
    assert active.phase is Phase.ACTIVE
    assert commands == [Command.CLAIM, Command.SUBSCRIBE]
    # When it is unassigned / Then it cancels, and releases only once drained
    draining, commands = step(active, Event.UNASSIGNED)
    assert (draining.phase, commands) == (Phase.DRAINING, [Command.CANCEL])
    releasing, commands = step(draining, Event.DRAINED)
    assert (releasing.phase, commands) == (Phase.RELEASING, [Command.RELEASE])
    idle, commands = step(releasing, Event.RELEASED)
    assert (idle.phase, commands) == (Phase.IDLE, [])


def test_new_owner_waits_for_the_old_claim_to_go() -> None:
    # Given a partition assigned to us while another member still holds its claim
    state, commands = run([Event.CLAIM_OTHER, Event.ASSIGNED])
    assert (state.phase, commands) == (Phase.WAITING, [])
    # When the claim is deleted / Then we claim, and subscribe only once the claim is ours
    state, commands = step(state, Event.CLAIM_FREE)
    assert (state.phase, commands) == (Phase.CLAIMING, [Command.CLAIM])
    state, commands = step(state, Event.CLAIMED)
    assert (state.phase, commands) == (Phase.SUBSCRIBING, [Command.SUBSCRIBE])


def test_refused_claim_waits_and_unassigned_claim_is_given_back() -> None:
    state, _ = run([Event.ASSIGNED])
    refused, commands = step(state, Event.CLAIM_REFUSED)
    assert (refused.phase, commands) == (Phase.WAITING, [])
    # Unassigned while the claim was in flight: give it back at once
    state, _ = run([Event.ASSIGNED, Event.UNASSIGNED])
    state, commands = step(state, Event.CLAIMED)
    assert (state.phase, commands) == (Phase.RELEASING, [Command.RELEASE])


def test_channel_lost_resubscribes_when_still_ours() -> None:
    state, _ = run([Event.ASSIGNED, Event.CLAIMED, Event.SUBSCRIBED])
    state, commands = step(state, Event.CHANNEL_LOST)
    assert (state.phase, commands) == (Phase.SUBSCRIBING, [Command.SUBSCRIBE])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list(Event)), max_size=40))
# a yielded partition left with no heir is drained (found by this test in CI, 2026-11-29:
# the rule below did not count YIELDING, which consumes on, as consuming)
@example([Event.ASSIGNED, Event.GRANTED, Event.SUBSCRIBED, Event.YIELD, Event.UNASSIGNED])
def test_no_subscribe_without_our_claim_and_no_release_without_drain(events: list[Event]) -> None:
    # Given any sequence of events the shell could deliver
    state = State()
    for event in events:
        before = state
        state, commands = step(state, event)
        # Then we subscribe only while we hold the claim
        if {Command.SUBSCRIBE, Command.ADOPT} & set(commands):
            assert state.holder is Holder.ME
        # and never release a partition that was being consumed without draining it,
        # unless the broker already dropped the channel (it requeued what was unacked)
        if Command.RELEASE in commands and before.phase in (Phase.ACTIVE, Phase.YIELDING):
            assert event is Event.CHANNEL_LOST, f"released an active partition on {event}"
        if Command.RELEASE in commands and before.phase is Phase.DRAINING:
            assert event in (Event.DRAINED, Event.CHANNEL_LOST, Event.EMPTIED)
        # and release before the cancel only once emptied (nothing in flight, all handled),
        # only a partition moved away, and then cut at once, after the release
        if Command.RELEASE in commands and event is Event.EMPTIED:
            assert commands == [Command.RELEASE, Command.CUT]
            assert before.phase is Phase.DRAINING and not before.assigned
            assert state.phase is Phase.HANDING
        # and cut only a drain that reported emptied
        if Command.CUT in commands:
            assert (before.phase, event) == (Phase.DRAINING, Event.EMPTIED)
        # and never consume again while the cancel of a released partition is under way
        if before.phase is Phase.HANDING:
            assert not {Command.SUBSCRIBE, Command.ADOPT, Command.CLAIM} & set(commands)
            assert state.phase is Phase.HANDING or event in (
                Event.DRAINED,
                Event.CHANNEL_LOST,
                Event.DROPPED,  # a fence: the broker requeued everything, nothing to finish
            )
        # and cancel only what we consume (YIELDING consumes on; a called-off drain: consumed
        # again; a drain whose claim became another's: cancelled again, as a waiting consumer)
        if Command.CANCEL in commands:
            assert before.phase in (Phase.ACTIVE, Phase.YIELDING, Phase.SUBSCRIBING) or (
                before.phase is Phase.DRAINING and event in (Event.KEPT, Event.CLAIM_OTHER)
            )
        # and call off only a drain of a partition that is ours, and consume on only then
        if Command.RESUME in commands:
            assert state.phase is Phase.DRAINING and state.assigned and not state.paused
            assert state.holder is Holder.ME
        if state.phase is Phase.ACTIVE and before.phase is Phase.DRAINING:
            assert event is Event.KEPT and state.assigned and state.holder is Holder.ME
        # and never subscribe while paused
        if {Command.SUBSCRIBE, Command.ADOPT} & set(commands):
            assert not state.paused


def test_a_paused_partition_is_drained_and_kept_then_resumed() -> None:
    # Given an active partition
    active, _ = run([Event.ASSIGNED, Event.CLAIMED, Event.SUBSCRIBED])
    # When it is paused / Then it drains, and once drained keeps its claim, unconsumed
    draining, commands = step(active, Event.PAUSED)
    assert (draining.phase, commands) == (Phase.DRAINING, [Command.CANCEL])
    paused, commands = step(draining, Event.DRAINED)
    assert (paused.phase, commands) == (Phase.PAUSED, [])
    assert paused.holder is Holder.ME
    # When it is resumed / Then it subscribes again
    resumed, commands = step(paused, Event.RESUMED)
    assert (resumed.phase, commands) == (Phase.SUBSCRIBING, [Command.SUBSCRIBE])
    # And a paused partition that is moved away is released
    moved, commands = step(paused, Event.UNASSIGNED)
    assert (moved.phase, commands) == (Phase.RELEASING, [Command.RELEASE])


def test_a_new_owner_of_a_paused_partition_claims_it_without_consuming() -> None:
    state, commands = run([Event.PAUSED, Event.ASSIGNED, Event.CLAIMED])
    assert (state.phase, commands) == (Phase.PAUSED, [Command.CLAIM])
    state, commands = run([Event.ASSIGNED, Event.CLAIMED, Event.PAUSED, Event.SUBSCRIBED])
    assert (state.phase, commands[-1]) == (Phase.DRAINING, Command.CANCEL)


def test_a_paused_partition_whose_claim_was_taken_waits_on_resume() -> None:
    # Given a paused partition whose claim another member took meanwhile (Hypothesis found it)
    state, _ = run([Event.ASSIGNED, Event.PAUSED, Event.CLAIMED, Event.CLAIM_OTHER])
    assert (state.phase, state.holder) == (Phase.WAITING, Holder.OTHER)
    # When it is resumed / Then it waits for the claim instead of subscribing without it
    state, commands = step(state, Event.RESUMED)
    assert (state.phase, commands) == (Phase.WAITING, [])


def test_an_emptied_drain_releases_before_the_cancel() -> None:
    # Given a partition moved away while active: it drains (acks held)
    draining, _ = run([Event.ASSIGNED, Event.CLAIMED, Event.SUBSCRIBED, Event.UNASSIGNED])
    assert draining.phase is Phase.DRAINING
    # When the broker proves nothing is in flight and every delivery was handled
    handing, commands = step(draining, Event.EMPTIED)
    # Then the claim goes first, and only then the cancel
    assert (handing.phase, commands) == (Phase.HANDING, [Command.RELEASE, Command.CUT])
    released, commands = step(handing, Event.RELEASED)
    assert (released.phase, released.holder, commands) == (Phase.HANDING, Holder.NOBODY, [])
    # and once the cancel and the held acks are done, nothing is left
    idle, commands = step(released, Event.DRAINED)
    assert (idle.phase, commands) == (Phase.IDLE, [])


def test_an_emptied_drain_whose_release_failed_releases_after_drained() -> None:
    # Given an emptied drain whose early release failed (etcd away: the shell retries it)
    handing, _ = run(
        [Event.ASSIGNED, Event.CLAIMED, Event.SUBSCRIBED, Event.UNASSIGNED, Event.EMPTIED]
    )
    # When the cancel is done before the retry / Then it releases again (the shell drops
    # a retry that finds the partition released or consumed again)
    releasing, commands = step(handing, Event.DRAINED)
    assert (releasing.phase, releasing.holder) == (Phase.RELEASING, Holder.ME)
    assert commands == [Command.RELEASE]
    idle, commands = step(releasing, Event.RELEASED)
    assert (idle.phase, commands) == (Phase.IDLE, [])


def test_a_claim_handed_over_to_us_is_consumed_without_a_claim_of_our_own() -> None:
    # Given a partition assigned to us while the old owner holds its claim
    waiting, _ = run([Event.CLAIM_OTHER, Event.ASSIGNED])
    assert waiting.phase is Phase.WAITING
    # When the old owner hands its claim over to us / Then we subscribe at once
    state, commands = step(waiting, Event.GRANTED)
    assert (state.phase, state.holder, commands) == (
        Phase.SUBSCRIBING,
        Holder.ME,
        [Command.SUBSCRIBE],
    )
    # and the answer of a claim we had sent meanwhile changes nothing
    claiming, _ = run([Event.ASSIGNED])
    state, commands = step(claiming, Event.GRANTED)
    assert (state.phase, commands) == (Phase.SUBSCRIBING, [Command.SUBSCRIBE])
    assert step(state, Event.CLAIMED) == (state, [])
    # A paused partition handed over is held, not consumed
    state, commands = run([Event.PAUSED, Event.CLAIM_OTHER, Event.ASSIGNED, Event.GRANTED])
    assert (state.phase, commands) == (Phase.PAUSED, [])


def test_a_claim_handed_over_after_we_were_moved_on_is_released() -> None:
    # Given a partition no longer assigned to us (the old owner's view lagged ours)
    state, _ = run([Event.CLAIM_OTHER, Event.ASSIGNED, Event.UNASSIGNED])
    # When its claim is handed over to us / Then we let it go at once
    state, commands = step(state, Event.GRANTED)
    assert (state.phase, commands) == (Phase.RELEASING, [Command.RELEASE])
    # and one handed back while our own cancel is under way goes once drained
    handing, _ = run(
        [Event.ASSIGNED, Event.CLAIMED, Event.SUBSCRIBED, Event.UNASSIGNED, Event.EMPTIED]
    )
    handing, _ = step(step(handing, Event.RELEASED)[0], Event.GRANTED)
    assert (handing.phase, handing.holder) == (Phase.HANDING, Holder.ME)
    state, commands = step(handing, Event.DRAINED)
    assert (state.phase, commands) == (Phase.RELEASING, [Command.RELEASE])


def test_an_emptied_drain_that_keeps_the_partition_cuts_without_releasing() -> None:
    # Given a paused partition (kept), and one whose claim vanished under it
    paused, _ = run([Event.ASSIGNED, Event.CLAIMED, Event.SUBSCRIBED, Event.PAUSED])
    freed, _ = run([Event.ASSIGNED, Event.CLAIMED, Event.SUBSCRIBED, Event.CLAIM_FREE])
    for draining in (paused, freed):
        # When the drain is emptied / Then it cancels without releasing first
        state, commands = step(draining, Event.EMPTIED)
        assert (state.phase, commands) == (Phase.DRAINING, [Command.CUT])
    assert step(step(paused, Event.EMPTIED)[0], Event.DRAINED)[0].phase is Phase.PAUSED


def test_a_drain_assigned_back_before_its_cancel_is_called_off() -> None:
    # Given a partition moved away, its drain holding acks
    draining, _ = run([Event.ASSIGNED, Event.CLAIMED, Event.SUBSCRIBED, Event.UNASSIGNED])
    # When it is assigned back to us / Then the drain is called off, not cut
    state, commands = step(draining, Event.ASSIGNED)
    assert (state.phase, commands) == (Phase.DRAINING, [Command.RESUME])
    emptied, commands = step(state, Event.EMPTIED)  # reported before the resume arrived
    assert (emptied.phase, commands) == (Phase.DRAINING, [Command.RESUME])
    kept, commands = step(emptied, Event.KEPT)
    assert (kept.phase, kept.holder, commands) == (Phase.ACTIVE, Holder.ME, [])
    # and one moved away again before the broker kept it is drained anew
    away, _ = step(state, Event.UNASSIGNED)
    assert step(away, Event.KEPT) == (away, [Command.CANCEL])
    # and a cancel already sent (no kept) releases and claims again once drained
    state, commands = step(state, Event.DRAINED)
    assert (state.phase, commands) == (Phase.RELEASING, [Command.RELEASE])
    # and a paused drain, or one whose claim went, is never resumed
    paused, _ = run([Event.ASSIGNED, Event.CLAIMED, Event.SUBSCRIBED, Event.PAUSED])
    assert Command.RESUME not in run([Event.UNASSIGNED, Event.ASSIGNED], paused)[1]
    freed, _ = run([Event.ASSIGNED, Event.CLAIMED, Event.SUBSCRIBED, Event.CLAIM_FREE])
    assert Command.RESUME not in run([Event.UNASSIGNED, Event.ASSIGNED], freed)[1]
    # but one paused and resumed while still ours is
    assert step(paused, Event.RESUMED)[1] == [Command.RESUME]


def test_a_move_back_while_handing_claims_again_once_drained() -> None:
    # Given a released partition whose cancel is under way
    handing, _ = run(
        [
            Event.ASSIGNED,
            Event.CLAIMED,
            Event.SUBSCRIBED,
            Event.UNASSIGNED,
            Event.EMPTIED,
            Event.RELEASED,
        ]
    )
    # When it is assigned back to us / Then nothing happens until drained, then we claim
    state, commands = step(handing, Event.ASSIGNED)
    assert (state.phase, commands) == (Phase.HANDING, [])
    state, commands = step(state, Event.DRAINED)
    assert (state.phase, commands) == (Phase.CLAIMING, [Command.CLAIM])
    # and if the next owner claimed it meanwhile, we wait for its claim to go
    state, _ = step(handing, Event.CLAIM_OTHER)
    state, _ = step(state, Event.ASSIGNED)
    state, commands = step(state, Event.CHANNEL_LOST)
    assert (state.phase, commands) == (Phase.WAITING, [])


# -- hot standby ----------------------------------------------------------------------------


def test_a_standby_stands_by_from_idle_and_is_promoted_on_its_takeover() -> None:
    # Given an idle partition the group wants us standing by for
    standing, commands = step(State(), Event.STANDBY_WANTED)
    assert (standing.phase, standing.standby, commands) == (
        Phase.IDLE,
        Standby.STANDING,
        [Command.STAND_BY],
    )
    # When RabbitMQ activates it / Then nothing is done until the takeover check
    activated, commands = step(standing, Event.ACTIVATED)
    assert (activated.standby, commands) == (Standby.ACTIVATED, [])
    # When our takeover claim is written / Then the standby becomes the subscription
    taken, commands = step(activated, Event.TAKEN_OVER)
    assert taken == State(Phase.ACTIVE, assigned=True, holder=Holder.ME)
    assert commands == [Command.PROMOTE]


def test_an_activation_by_a_planned_move_is_given_back() -> None:
    activated, _ = run([Event.STANDBY_WANTED, Event.ACTIVATED])
    state, commands = step(activated, Event.TAKEOVER_REFUSED)
    assert (state.phase, state.standby, commands) == (Phase.IDLE, Standby.NONE, [Command.GIVE_BACK])
    # and an activation of a standby we stood down already goes back at once
    stood_down, commands = run([Event.STANDBY_WANTED, Event.STANDBY_UNWANTED])
    assert (stood_down.standby, commands) == (Standby.NONE, [Command.STAND_BY, Command.STAND_DOWN])
    assert step(stood_down, Event.ACTIVATED) == (stood_down, [Command.GIVE_BACK])


def test_a_standby_is_only_for_a_partition_we_do_not_consume() -> None:
    # Given a partition we consume / When the group wants a standby / Then none is made
    active, _ = run([Event.ASSIGNED, Event.CLAIMED, Event.SUBSCRIBED])
    assert step(active, Event.STANDBY_WANTED) == (active, [])
    # Given a standby that is still standing when the partition becomes ours to consume
    standing, _ = run([Event.STANDBY_WANTED, Event.CLAIM_OTHER, Event.ASSIGNED])
    assert (standing.phase, standing.standby) == (Phase.WAITING, Standby.STANDING)
    # When its claim is handed to us / Then the standby subscription becomes ours: adopted
    # (it keeps its place in the queue's line), not stood down for a subscription beside it
    state, commands = step(standing, Event.GRANTED)
    assert (state.phase, state.standby) == (Phase.SUBSCRIBING, Standby.NONE)
    assert commands == [Command.ADOPT]
    # and one activated meanwhile is adopted too, what it was sent going to the new worker
    activated, _ = step(standing, Event.ACTIVATED)
    state, commands = step(activated, Event.GRANTED)
    assert (state.standby, commands) == (Standby.NONE, [Command.ADOPT])


def test_a_lost_standby_and_a_stale_takeover_decision_change_nothing_more() -> None:
    standing, _ = run([Event.STANDBY_WANTED])
    lost, commands = step(standing, Event.STANDBY_LOST)
    assert (lost, commands) == (State(), [])
    # a decision reaching a standby that is gone (lost before the check) is dropped
    assert step(lost, Event.TAKEN_OVER) == (lost, [])
    assert step(lost, Event.TAKEOVER_REFUSED) == (lost, [])


def test_a_drop_starts_over_from_idle_with_no_standby() -> None:
    active, _ = run([Event.ASSIGNED, Event.CLAIMED, Event.SUBSCRIBED])
    assert step(active, Event.DROPPED) == (State(), [])
    # the fence aborted the standby subscription too: standing no more, so a sync stands by again
    standing, _ = run([Event.STANDBY_WANTED, Event.CLAIM_OTHER, Event.ASSIGNED])
    assert step(standing, Event.DROPPED) == (State(), [])


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(list(Event)), max_size=40))
def test_a_standby_never_runs_beside_our_consumption_and_is_promoted_only_once_activated(
    events: list[Event],
) -> None:
    # Given any sequence of events, standby ones mixed in
    state = State()
    for event in events:
        before = state
        state, commands = step(state, event)
        # Then a standby never lives beside our own consumption of the partition
        assert not (state.consuming and state.standby is not Standby.NONE)
        # and a standby subscription is made only for an idle partition, or one we wait
        # for as its heir (partq.consumers.state.priority)
        if Command.STAND_BY in commands:
            assert before.phase in (Phase.IDLE, Phase.WAITING)
            assert before.standby is Standby.NONE
            assert state.standby is Standby.STANDING
        # and promoted only once activated, onto our takeover claim, consumed at once
        if Command.PROMOTE in commands:
            assert (before.standby, event) == (Standby.ACTIVATED, Event.TAKEN_OVER)
            assert state == State(Phase.ACTIVE, assigned=True, holder=Holder.ME)
        # and adopted only as we subscribe on our claim, in place of the subscribe
        if Command.ADOPT in commands:
            assert before.standby is not Standby.NONE and Command.SUBSCRIBE not in commands
            assert state.phase is Phase.SUBSCRIBING and state.holder is Holder.ME
        if before.standby is Standby.ACTIVATED and state.standby is Standby.NONE:
            # and an activated standby ends promoted, adopted, given back, or lost with its
            # channel (or its connection: a fence)
            ends = {Command.PROMOTE, Command.ADOPT, Command.GIVE_BACK} & set(commands)
            lost = (Event.STANDBY_LOST, Event.DROPPED)
            assert ends or event in lost, (before, event, state, commands)
        # and only what was activated (or stood down meanwhile) is given back
        if Command.GIVE_BACK in commands:
            assert before.standby is Standby.ACTIVATED or (
                event is Event.ACTIVATED and before.standby is Standby.NONE
            )
        # and a standby command never comes with a claim or a release
        if {Command.STAND_BY, Command.PROMOTE} & set(commands):
            assert not {Command.CLAIM, Command.RELEASE} & set(commands)
        # and a drop leaves nothing consumed
        if event is Event.DROPPED:
            assert (state.phase, commands) == (Phase.IDLE, [])


def test_a_move_by_priority_consumes_on_until_the_heir_takes_the_claim() -> None:
    # Given an active partition
    active, _ = run([Event.ASSIGNED, Event.CLAIMED, Event.SUBSCRIBED])
    # When it moves to an heir that outranks us / Then nothing is cancelled: we consume on
    yielding, commands = step(active, Event.YIELD)
    assert (yielding.phase, yielding.assigned, commands) == (Phase.YIELDING, False, [])
    assert yielding.consuming
    # When the heir takes the claim over (the broker switched) / Then we cancel and release
    draining, commands = step(yielding, Event.CLAIM_OTHER)
    assert (draining.phase, commands) == (Phase.DRAINING, [Command.CANCEL])
    state, commands = step(draining, Event.DRAINED)
    assert (state.phase, commands) == (Phase.RELEASING, [Command.RELEASE])


def test_a_yield_assigned_back_consumes_on_and_one_without_heir_drains() -> None:
    yielding, _ = run([Event.ASSIGNED, Event.CLAIMED, Event.SUBSCRIBED, Event.YIELD])
    back, commands = step(yielding, Event.ASSIGNED)
    assert (back.phase, back.assigned, commands) == (Phase.ACTIVE, True, [])
    for event in (Event.UNASSIGNED, Event.PAUSED, Event.CLAIM_FREE):
        state, commands = step(yielding, event)
        assert (state.phase, commands) == (Phase.DRAINING, [Command.CANCEL]), event
    state, commands = step(yielding, Event.CHANNEL_LOST)
    assert (state.phase, commands) == (Phase.RELEASING, [Command.RELEASE])


def test_a_yield_of_a_partition_not_active_is_an_unassignment() -> None:
    waiting, _ = run([Event.CLAIM_OTHER, Event.ASSIGNED])
    assert step(waiting, Event.YIELD) == step(waiting, Event.UNASSIGNED)


def test_an_heir_stands_by_from_waiting_and_is_promoted_on_its_takeover() -> None:
    waiting, _ = run([Event.CLAIM_OTHER, Event.ASSIGNED])
    heir, commands = step(waiting, Event.STANDBY_WANTED)
    assert heir == replace(waiting, standby=Standby.STANDING)
    assert commands == [Command.STAND_BY]
    heir, _ = step(heir, Event.ACTIVATED)
    state, commands = step(heir, Event.TAKEN_OVER)
    assert (state.phase, state.holder, commands) == (Phase.ACTIVE, Holder.ME, [Command.PROMOTE])
    # A refused one gives back and waits; a claim freed meanwhile claims, then adopts (the
    # broker gives an heir of another priority back and subscribes anew:
    # partq.consumers.broker.channels)
    assert step(heir, Event.TAKEOVER_REFUSED) == (waiting, [Command.GIVE_BACK])
    state, issued = run([Event.CLAIM_FREE, Event.CLAIMED], heir)
    assert state.phase is Phase.SUBSCRIBING
    assert issued == [Command.CLAIM, Command.ADOPT]
