"""SIGINT/SIGTERM as a request to stop, the same on every rank.

Job: while `stop_on_signals()` is active (the whole `hybrid-engine train`
command, from before the engines are built to after `final/` is written;
`Controller.run` for an embedding trainer), SIGINT and SIGTERM only record
the request. The controller reads `requested()` at each step boundary through
a collective OR (`parallel.dist.any_rank`), so a signal to torchrun (which
forwards SIGTERM to every rank) and a signal to one rank (a scheduler, an OOM
handler) end the same way: every rank finishes the step in progress, the
checkpoint is written when checkpointing is on, `final/` is exported, and the
process exits 0. A signal during start-up or during the final export no
longer kills a rank half-way (which left `final.tmp-*` folders and took the
job down with a traceback); one during start-up stops before the first step.

Only the main thread can set handlers; elsewhere `stop_on_signals` is a no-op.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["requested", "reset", "restore_handlers", "stop_on_signals"]

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_GRACE_S = 0.05  # for C signal handlers in flight when the disposition changes
_requested: int | None = None
_depth = 0  # nesting of stop_on_signals; the outermost starts with no request


def requested() -> int | None:
    """The first signal received since `reset` (None: none)."""
    return _requested


def reset() -> None:
    """Forgets a received signal (a new run in the same process)."""
    global _requested
    _requested = None


def _peer_left_with_error() -> bool:
    """Whether a peer has said it leaves with an error of its own: the SIGTERM that
    torchrun then sends is no user's request to stop, and not worth a line."""
    from hybrid_engine.parallel import watchdog

    return watchdog.peer_left_with_error()


def _request(signum: int, frame: Any) -> None:  # noqa: ARG001
    global _requested
    if _requested is None and not _peer_left_with_error():
        log.warning("rank %s got %s: stopping after the current step (checkpoint when "
                    "checkpointing is on, then final/), exit code 0",
                    os.environ.get("RANK", "0"), signal.Signals(signum).name)
    _requested = signum


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within: SIGINT/SIGTERM set `requested()` instead of ending the process.
    The outermost use starts with no request; an inner one (the controller's
    inside the CLI's) keeps what the outer received. Restores the previous
    handlers on exit."""
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _depth == 0:
        reset()
    previous = {sig: signal.signal(sig, _request) for sig in SIGNALS}
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        restore_handlers(previous)


def restore_handlers(previous: dict[int, Any]) -> None:
    """Puts back `previous` ({signal: handler}) without dropping a signal in flight
    with a traceback. CPython runs a signal's Python handler after its C handler
    has flagged it; restored straight to SIG_DFL/SIG_IGN, a signal flagged just
    before (on any thread) finds no handler: "ignored due to race condition". So
    the kernel's disposition changes first (libc `signal`: from then on no signal
    is flagged), C handlers already running get a grace period to finish (a thread
    can be preempted inside one), flagged signals run the current handler, and only
    then does Python's table change."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    native = [sig for sig, handler in previous.items() if handler in (signal.SIG_DFL,
                                                                       signal.SIG_IGN)]
    for sig in native:
        libc.signal(ctypes.c_int(sig), ctypes.c_void_p(int(previous[sig])))
    if native:
        time.sleep(_GRACE_S)
    signal.pthread_sigmask(signal.SIG_BLOCK, [])  # runs the handlers of flagged signals
    for sig, handler in previous.items():
        signal.signal(sig, handler)
