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


_STORM_CHILD = """
import logging, signal, sys, threading, time
from hybrid_engine.parallel import signals, watchdog  # noqa: F401 (watchdog: the handler's import)
logging.disable(logging.CRITICAL)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # a second thread, as in a rank
print("ready", flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    with signals.stop_on_signals():
        pass
"""


def test_leaving_the_context_under_a_storm_of_signals_drops_none_with_a_traceback(tmp_path) -> None:
    """SIGTERM sent without pause for 3 s at a process (two threads, SIGTERM
    ignored outside) that enters and leaves `stop_on_signals` in a loop: no
    "ignored due to race condition" traceback (a plain `signal.signal` restore of
    SIG_IGN prints about 10 per second here), and the process lives."""
    import subprocess
    import sys

    script = tmp_path / "child.py"
    script.write_text(_STORM_CHILD)
    err = tmp_path / "err.txt"
    with err.open("w") as stderr:
        child = subprocess.Popen([sys.executable, str(script), "3"], stdout=subprocess.PIPE,
                                 stderr=stderr, text=True)
        assert child.stdout.readline().strip() == "ready"
        sent = 0
        while child.poll() is None:
            try:
                os.kill(child.pid, signal.SIGTERM)
            except ProcessLookupError:
                break
            sent += 1
        child.wait()
    assert sent > 1000
    assert child.returncode == 0, err.read_text()[-2000:]
    assert "race condition" not in err.read_text(), err.read_text()[-2000:]
