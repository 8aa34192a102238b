"""FlagTicket.synchronize on the CPU: a real thread raises the lane's flag (as the GPU kernel
does through pinned memory) at a random moment; synchronize must return only once it is up,
whether the lane's learned rate says the transfer is due much sooner, much later, or nothing
is known yet, and a landed transfer teaches its lane the fastest rate seen."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from kvtier.transfer.cuda import tickets
from kvtier.transfer.cuda.tickets import FlagTicket, StreamLane
from tests.conftest import cpu_lane

LAYERS = 4


def _lane() -> StreamLane:
    return cpu_lane(LAYERS)


def _ticket(lane: StreamLane, nbytes: int) -> FlagTicket:
    with lane.lock:
        seq = lane.next_seq()
        buffer = lane.buffer(8)
    return FlagTicket(lane, seq, buffer, 8, False, torch.device("cpu"), nbytes)


def _land_later(lane: StreamLane, seq: int, delay_s: float, landed_at: list) -> threading.Thread:
    def land():
        time.sleep(delay_s)
        for layer in range(LAYERS + 1):  # layers first, then the transfer's own flag, as the kernel signals
            lane.flags[layer] = seq
        landed_at.append(time.perf_counter())

    thread = threading.Thread(target=land)
    thread.start()
    return thread


@pytest.mark.parametrize("rate", [0.0, 1e6, 1e9, 1e13])  # unknown; due in 1 s; due about now; due at once
def test_synchronize_returns_only_after_the_flag_rises(rate):
    rng = random.Random(int(rate) % 1000 + 7)
    lane = _lane()
    lane.bytes_per_s = rate
    for _ in range(12):
        nbytes = rng.choice([0, 4096, 1 << 20, 3 << 20])
        ticket = _ticket(lane, nbytes)
        landed_at: list[float] = []
        thread = _land_later(lane, ticket._seq, rng.uniform(0, 0.004), landed_at)
        ticket.synchronize()
        returned = time.perf_counter()
        thread.join(10)
        assert ticket.done()
        assert landed_at and returned >= landed_at[0], "synchronize returned before the flag rose"


def test_a_transfer_due_long_after_it_lands_is_not_waited_for_past_a_sleep():
    """The lane believes in a rate far too slow for this transfer (due in 1 s): the sleep phase
    checks the flag after each sleep of at most MAX_SLEEP_S, so it returns soon after landing."""
    lane = _lane()
    lane.bytes_per_s = 1e6
    ticket = _ticket(lane, 1 << 20)
    landed_at: list[float] = []
    thread = _land_later(lane, ticket._seq, 0.002, landed_at)
    ticket.synchronize()
    thread.join(10)
    assert ticket.done() and landed_at
    assert lane.bytes_per_s > 1e6  # it learned a faster rate from this transfer


def test_landed_transfers_teach_the_lane_the_fastest_rate():
    lane = _lane()
    small = _ticket(lane, tickets.RATE_MIN_BYTES - 1)
    lane.flags[LAYERS] = small._seq
    assert small.done() and lane.bytes_per_s == 0.0  # too small to say anything
    rates = []
    for delay in (0.003, 0.001, 0.002):
        ticket = _ticket(lane, 4 << 20)
        time.sleep(delay)
        lane.flags[LAYERS] = ticket._seq
        assert ticket.done()
        rates.append(lane.bytes_per_s)
    assert rates[0] > 0 and rates[1] > rates[0] and rates[2] == rates[1]
    assert rates[1] <= (4 << 20) / 0.001  # counted from submission: never faster than it ran
