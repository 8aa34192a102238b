"""ChangeSignal: a waiter wakes for every notification after the generation it read, never misses one."""

import threading
import time

from kvtier.pool.signal import ChangeSignal


def test_a_notification_before_the_wait_is_not_missed():
    lock = threading.Lock()
    signal = ChangeSignal(lock)
    with lock:
        seen = signal.generation
    # Another thread notifies in the gap between reading the generation and waiting.
    t = threading.Thread(target=lambda: (lock.acquire(), signal.notify_all(), lock.release()))
    t.start()
    t.join()
    with lock:
        start = time.monotonic()
        assert signal.wait_past(seen, timeout=30.0) is True
        assert time.monotonic() - start < 5.0  # returned at once, not at the timeout
        assert signal.generation == seen + 1


def test_a_wait_ends_at_the_next_notification_or_the_timeout():
    lock = threading.Lock()
    signal = ChangeSignal(lock)
    with lock:
        seen = signal.generation
        assert signal.wait_past(seen, timeout=0.05) is False  # nothing happened
        assert signal.generation == seen
    woke = []

    def waiter():
        with lock:
            woke.append(signal.wait_past(seen, timeout=30.0))

    t = threading.Thread(target=waiter)
    t.start()
    while True:  # the waiter is asleep on the condition once it has let the lock go
        with lock:
            if signal._waiters:
                signal.notify_all()
                break
        time.sleep(0.001)
    t.join(timeout=30.0)
    assert woke == [True]


def test_many_threads_each_see_every_notification():
    lock = threading.Lock()
    signal = ChangeSignal(lock)
    rounds, threads = 200, 4
    seen = [[] for _ in range(threads)]  # the generation each watcher saw at start and at each wake

    def watcher(i):
        with lock:
            gen = signal.generation
            seen[i].append(gen)
            while gen < rounds:
                signal.wait_past(gen, timeout=30.0)
                gen = signal.generation
                seen[i].append(gen)

    workers = [threading.Thread(target=watcher, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    for _ in range(rounds):
        with lock:
            signal.notify_all()
    for t in workers:
        t.join(timeout=60.0)
    for got in seen:
        assert got[-1] == rounds  # each watcher reached the last notification
        assert got == sorted(set(got))  # and never woke without a new one
