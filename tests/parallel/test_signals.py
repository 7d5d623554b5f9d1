"""SIGINT/SIGTERM as a stop request (parallel/signals.py): recorded, not fatal,
while active; nested uses share the request; the previous handlers come back."""

from __future__ import annotations

import os
import signal

from hybrid_engine.parallel import signals


def test_a_signal_is_recorded_not_fatal_and_handlers_come_back() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with signals.stop_on_signals():
        assert signals.requested() is None
        os.kill(os.getpid(), signal.SIGTERM)  # without the handler: this process dies
        assert signals.requested() == signal.SIGTERM
        with signals.stop_on_signals():  # the controller's, inside the CLI's
            assert signals.requested() == signal.SIGTERM  # kept, not reset
            os.kill(os.getpid(), signal.SIGINT)
        assert signals.requested() == signal.SIGINT
    assert signal.getsignal(signal.SIGTERM) is before
    with signals.stop_on_signals():  # a new outermost use starts afresh
        assert signals.requested() is None


def test_only_the_main_thread_sets_handlers() -> None:
    import threading

    seen = []

    def other() -> None:
        with signals.stop_on_signals():
            seen.append(signal.getsignal(signal.SIGTERM))

    before = signal.getsignal(signal.SIGTERM)
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == [before]
