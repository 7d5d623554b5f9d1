"""The watchdog: a stopped, dead or hung peer takes the job down instead of hanging it.

Job: torch's collectives time out (`collective_timeout_s`), but vLLM's own
all-reduces do not: the CPU shared-memory all-reduce and, on GPU, pynccl and
the custom all-reduce spin forever on a peer that never arrives, and torchrun
reacts only to ranks that exit. Every rank therefore runs a daemon thread that,
every `interval_s`, publishes to the launcher's key-value store (its own client
connection, so a main thread blocked in the store cannot stall it) a beat
count, the rank's phase and its progress count, and reads every peer's. It
aborts the whole job when

- a peer's beat has not changed for `timeout_s`: the peer is stopped
  (SIGSTOP, a frozen VM), dead without its launcher noticing, or its
  interpreter is wedged. The message names the silent rank and its phase;
- this rank's progress (phase entries) has not changed for `timeout_s` while a
  peer's differs: the ranks wait in different phases, in a collective that no
  one will complete. Ranks that all sit in the same phase are all working
  (a long generate), never an abort;
- a peer on this host has died (its process is gone or a zombie: SIGKILL, the
  OOM killer, a crash), checked every `TICK_S` from the pids the peers
  publish: the message names the rank and the phase it died in (published at
  each phase change). A peer that reported its own error first (`left_with_error`)
  is not a death: the survivors leave silently, its line said it all.

Aborting: the first rank to decide posts its message in the store and prints
one `error: ...` line; it SIGKILLs silent peers on its own host (a stopped
process would otherwise hold the launcher for its 30 s grace), runs the
registered cleanup hooks (the engine's shared-memory segments), and every rank
leaves with `os._exit(2)` (the CLI's code for a run that stopped itself)
within a tick of the post, whatever its main thread waits in (a collective,
vLLM's shared-memory all-reduce spin). A main thread whose collective failed
because a peer died (gloo: "Connection reset by peer") calls `settle()` before
showing a traceback: the verdict about the peer comes first. A peer on another
host cannot be seen dying; the closed connection says it, and the peer whose
beat then stops for two periods is the one named.

Under torchrun, a rank whose launcher dies (SIGKILL, OOM), so that nothing
will stop it, leaves the same way within half a second: `watch_launcher()`,
which the CLI starts first thing, before the rendezvous (a rank orphaned at
start-up would otherwise wait in it for the store's timeout), runs a thread
that compares the parent pid with torchrun's; a rank whose parent is already
init or not a Python process when it starts (it was adopted) leaves at once.

Phases come from `phase(name)` (the controller's phase timer: generate, score,
train, sync, eval; the policy's save; build and export). A rank that shuts down
cleanly says so, and its silence afterwards is not a fault.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator

import torch.distributed as dist

__all__ = ["Watchdog", "add_cleanup", "current", "left_with_error", "peer_left_with_error",
           "phase", "set_group", "settle", "start", "stop", "watch_launcher"]

log = logging.getLogger("hybrid_engine.watchdog")

_KEY = "hybrid_engine/watchdog/"
_ABORT_KEY = _KEY + "abort"
_EXIT_CODE = 2
TICK_S = 0.25  # how often the thread looks for an abort post and for dead peers on this host
_ACTIVE: Watchdog | None = None
_CLEANUPS: list[Callable[[], None]] = []


def add_cleanup(fn: Callable[[], None]) -> None:
    """Registers fn to run (best effort) before the watchdog ends the process
    (once, however often it is registered)."""
    if fn not in _CLEANUPS:
        _CLEANUPS.append(fn)


def current() -> Watchdog | None:
    """The running watchdog of this process, if any."""
    return _ACTIVE


def set_group(name: str) -> None:
    """Names the group of ranks this rank belongs to (placement=grouped: its roles,
    e.g. "critic"), published with its beat: a peer that sees it die names the
    group too. A no-op without a running watchdog."""
    wd = _ACTIVE
    if wd is not None:
        wd.group = name
        with contextlib.suppress(Exception):
            wd._publish()


def _group_of(state: dict) -> str:
    """', <name> group' for a peer that published one, else ''."""
    return f", {state['group']} group" if state.get("group") else ""


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Marks this rank as in phase `name` for the block (progress + 1 on entry
    and exit); a no-op without a running watchdog."""
    wd = _ACTIVE
    if wd is None:
        yield
        return
    previous = wd.enter(name)
    try:
        yield
    except BaseException:
        wd.failed_in = wd.failed_in or name
        raise
    finally:
        wd.enter(previous)


_launcher_thread: threading.Thread | None = None


def _looks_like_launcher(pid: int, proc: str = "/proc") -> bool:
    """pid could be torchrun: a Python process (torchrun, `python -m
    torch.distributed.run`, accelerate and any launcher built on torch's elastic
    agent are); True when unreadable. PID 1 is init, which adopts orphans,
    unless it is torchrun itself (a container's entrypoint, its own PID
    namespace): then it names torchrun or torch.distributed.run."""
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return pid != 1
    if pid == 1:
        return b"torchrun" in cmdline or b"torch.distributed.run" in cmdline
    return b"python" in cmdline or b"torchrun" in cmdline


def watch_launcher(interval_s: float = 0.5) -> None:
    """Under torchrun (TORCHELASTIC_RUN_ID set): a daemon thread ends this rank
    with one error line (from local rank 0) and exit code 2 when its parent is
    no longer the launcher. Call as early as possible; idempotent; a no-op
    outside torchrun."""
    global _launcher_thread
    if "TORCHELASTIC_RUN_ID" not in os.environ or _launcher_thread is not None:
        return
    launcher = os.getppid()
    if not _looks_like_launcher(launcher):  # it died before this rank got here
        _launcher_gone(f"the launcher (torchrun) was gone before rank "
                       f"{os.environ.get('RANK', '?')} started")

    def run() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != launcher:
                _launcher_gone(f"the launcher (torchrun, pid {launcher}) is gone")

    _launcher_thread = threading.Thread(target=run, name="hybrid-engine-launcher", daemon=True)
    _launcher_thread.start()


def _launcher_gone(msg: str) -> None:
    """One line per host, the watchdog's cleanups, exit code 2."""
    wd = _ACTIVE
    where = f"; rank {os.environ.get('RANK', '?')} stops in phase " \
        f"{wd.phase if wd is not None else 'start'!r}"
    say = os.environ.get("LOCAL_RANK", "0") == "0"
    if wd is not None:
        wd._exit(msg + where, [], post=False, say=say)
    if say:
        print(f"error: {msg}{where}", file=sys.stderr, flush=True)
    for fn in _CLEANUPS:
        with contextlib.suppress(Exception):
            fn()
    os._exit(_EXIT_CODE)


def start(timeout_s: float, *, interval_s: float | None = None) -> Watchdog | None:
    """Starts this process's watchdog when the default group has more than one
    rank (every rank must call it). Idempotent; None on one rank or without an
    env:// launch's MASTER_ADDR/MASTER_PORT."""
    global _ACTIVE
    if _ACTIVE is not None:
        return _ACTIVE
    watch_launcher()  # an embedding trainer's ranks too (the CLI started it earlier)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if not {"MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
        log.warning("no watchdog: MASTER_ADDR/MASTER_PORT unset (not an env:// launch); "
                    "a stopped peer inside vLLM's all-reduce can hang this job")
        return None
    _ACTIVE = Watchdog(dist.get_rank(), dist.get_world_size(), timeout_s,
                       interval_s=interval_s)
    return _ACTIVE


def settle(wait_s: float = 3.0, reported_wait_s: float = 20.0,
           error: BaseException | None = None) -> None:
    """For a main thread with an exception in flight: gives the watchdog
    `wait_s` to end this process if the exception came from a peer's death
    or another rank's abort (a collective fails as soon as the dead peer's
    sockets close, a moment before its process is seen gone), and up to
    `reported_wait_s` when a peer is leaving with an error of its own (it
    prints its line first, then exits: this rank then leaves silently).
    When `error` says a peer closed its connection and no peer on this host
    died, the peer is on another host: the watchdog names the one whose beat
    stopped (`Watchdog.name_gone_peer`).
    Returns if the watchdog found nothing: the exception is this rank's own."""
    wd = _ACTIVE
    if wd is None or wd._done.is_set():
        return
    start, limit = time.monotonic(), wait_s
    while time.monotonic() - start < limit:
        wd._wake.set()
        time.sleep(TICK_S)
        if limit == wait_s and wd.peer_reported_error():
            limit = reported_wait_s
    if error is not None and any(m in str(error) for m in _CLOSED):
        wd.name_gone_peer()


# How gloo (and NCCL's TCP store) word a collective whose peer's sockets closed.
_CLOSED = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def left_with_error(msg: str) -> None:
    """Says in the store that this rank reports `msg` itself and will exit: once
    its process is gone its peers leave silently instead of reporting a death.
    Before the watchdog starts (a preflight error), the default group's store
    carries it, for `peer_left_with_error`."""
    wd = _ACTIVE
    if wd is not None:
        wd.error = msg
        with contextlib.suppress(Exception):
            wd.store.set(wd._key(wd.rank), json.dumps({"done": True, "error": msg}))
    elif (store := _group_store()) is not None:
        with contextlib.suppress(Exception):
            store.set(f"{_KEY}{dist.get_rank()}", json.dumps({"done": True, "error": msg}))


def peer_left_with_error() -> bool:
    """Whether a peer has said it leaves with an error of its own (`left_with_error`),
    through the watchdog or, before it started, the default group's store."""
    if _ACTIVE is not None and _ACTIVE.peer_reported_error():
        return True
    store = _group_store()
    with contextlib.suppress(Exception):
        keys = [f"{_KEY}{r}" for r in range(dist.get_world_size()) if r != dist.get_rank()]
        return any(store.check([k]) and json.loads(store.get(k)).get("error") for k in keys)
    return False


def _group_store() -> dist.Store | None:
    """The default process group's store (None without one, or on one rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.distributed_c10d._get_default_store()


def stop() -> None:
    """Stops the watchdog after telling the peers this rank is done (a clean
    shutdown is not a silent rank). Called while an exception is being handled
    (a job that failed to start shuts its engine down before the error reaches
    the CLI), it says this rank leaves with that error: its peers, waiting in a
    collective it will never join, then leave silently instead of showing the
    closed connection as a traceback."""
    global _ACTIVE
    wd, _ACTIVE = _ACTIVE, None
    if wd is not None:
        if wd.error is None and (exc := sys.exc_info()[1]) is not None:
            wd.error = str(exc) or type(exc).__name__
        wd.close()


def _host_and_pid_namespace() -> str:
    """This host's name and PID namespace: peers with the same value can check
    each other's pids (two containers may share a host name, not a namespace)."""
    try:
        return f"{socket.gethostname()}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return socket.gethostname()


def pid_alive(pid: int) -> bool:
    """Whether process pid exists and is not a zombie (Linux /proc; True where
    it cannot be read: then only the silence rule judges it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        return True


def _connect(timeout_s: float) -> dist.Store:
    """A client of the launcher's store of its own (torchrun's agent store, or
    rank 0's under a plain env:// launch)."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


class Watchdog:
    """One rank's watchdog thread (see the module doc).

    Args:
        rank, world_size: this rank in the default group.
        timeout_s: silence (or disagreeing progress) that aborts the job.
        interval_s: publish/check period; default timeout_s / 10 in [0.5, 5] s.
        store: the key-value store to use; default a new client of the launcher's.
        thread: start the thread (False: tests drive `check` and `judge_dead`).
    """

    def __init__(self, rank: int, world_size: int, timeout_s: float, *,
                 interval_s: float | None = None, store: dist.Store | None = None,
                 thread: bool = True) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.interval_s = interval_s or min(5.0, max(0.5, timeout_s / 10))
        # Silence is measured from the last beat seen, up to two periods after the
        # peer's last sign of life; deciding 3 periods early keeps the verdict within
        # timeout_s of it, ahead of the collective (gloo, NCCL) that would time out
        # with a traceback instead of one error line.
        self.silence_s = max(self.interval_s, timeout_s - 3 * self.interval_s)
        self.store = store or _connect(min(timeout_s, 30.0))
        self.phase, self.progress, self.beat = "build", 0, 0
        self.group: str | None = None  # `set_group`: named in a peer's verdict on this rank
        self.failed_in: str | None = None  # the innermost phase an exception left
        self.error: str | None = None  # what this rank reported itself (left_with_error)
        self._progress_at = time.monotonic()
        self._seen: dict[int, tuple[int, float, dict]] = {}  # peer -> (beat, when, state)
        self._local_pids: dict[int, int] = {}  # peer on this host -> its pid
        self._host = _host_and_pid_namespace()
        self._done = threading.Event()
        self._wake = threading.Event()  # look now, not at the next tick
        self._publish()
        self._thread = threading.Thread(target=self._run, name="hybrid-engine-watchdog",
                                        daemon=True)
        if thread:
            self._thread.start()
        log.info("watchdog on: a rank silent or stuck for %.0f s aborts the job", timeout_s)

    # --- the main thread's side --------------------------------------------------

    def enter(self, name: str) -> str:
        """Marks a phase change; returns the previous phase."""
        previous, self.phase = self.phase, name
        self.progress += 1
        self._progress_at = time.monotonic()
        with contextlib.suppress(Exception):  # now, not at the next beat: a peer that
            self._publish()                   # sees this rank die names this phase
        return previous

    def close(self) -> None:
        self._done.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s * 2 + 5)
        done = {"done": True} if self.error is None else {"done": True, "error": self.error}
        with contextlib.suppress(Exception):
            self.store.set(self._key(self.rank), json.dumps(done))

    def peer_reported_error(self) -> bool:
        """Whether a peer has said it leaves with an error of its own."""
        with contextlib.suppress(Exception):
            return any((self._state(r) or {}).get("error")
                       for r in range(self.world_size) if r != self.rank)
        return False

    # --- the thread ------------------------------------------------------------

    def _key(self, rank: int) -> str:
        return f"{_KEY}{rank}"

    def _publish(self) -> None:
        self.store.set(self._key(self.rank), json.dumps({
            "beat": self.beat, "phase": self.phase, "progress": self.progress,
            "pid": os.getpid(), "host": self._host, "group": self.group}))

    def _run(self) -> None:
        store_failing_since, next_beat = None, time.monotonic() + self.interval_s
        while not self._done.is_set():
            self._wake.wait(min(TICK_S, self.interval_s))
            self._wake.clear()
            if self._done.is_set():
                return
            self._tick()
            if time.monotonic() < next_beat:
                continue
            next_beat = time.monotonic() + self.interval_s
            self.beat += 1
            try:
                self._publish()
                verdict = self.check(self._read_peers(), time.monotonic())
                store_failing_since = None
            except Exception as e:  # noqa: BLE001 -- the store's host may be gone
                now = time.monotonic()
                store_failing_since = store_failing_since or now
                verdict = None
                if now - store_failing_since > self.timeout_s:
                    verdict = (f"the launcher's key-value store has not answered for "
                               f"{self.timeout_s:.0f} s ({type(e).__name__}: {e})", [])
            if self._done.is_set():
                return
            if verdict is not None:
                self._exit(*verdict)

    def _tick(self) -> None:
        """Leaves (silently) when another rank has posted an abort; aborts when
        a peer on this host has died."""
        if self._aborted_elsewhere():
            self._exit(None, [])
        with contextlib.suppress(Exception):  # a failing store is the beat's to judge
            self._learn_local_pids()
            dead = {r: pid for r, pid in self._local_pids.items() if not pid_alive(pid)}
            if dead:
                msg, reported = self.judge_dead(dead, {r: self._state(r) for r in dead})
                if msg is not None or reported:
                    self._exit(msg, [])

    def _state(self, rank: int) -> dict | None:
        key = self._key(rank)
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def _learn_local_pids(self) -> None:
        if len(self._local_pids) == self.world_size - 1 or self.beat > 3:
            return  # all known, or the rest are on other hosts (or never started)
        for r in range(self.world_size):
            if r != self.rank and r not in self._local_pids:
                state = self._state(r)
                if state and state.get("host") == self._host and state.get("pid"):
                    self._local_pids[r] = int(state["pid"])

    def judge_dead(self, dead: dict[int, int],
                   states: dict[int, dict | None]) -> tuple[str | None, bool]:
        """Peers whose processes are gone ({rank: pid}, with their last published
        states): (the abort message naming them and their phases, or None;
        whether one of them reported its own error, so this rank leaves
        silently). A peer that said it was done is forgotten."""
        died, reported = [], False
        for r, pid in sorted(dead.items()):
            state = states.get(r) or {}
            if state.get("done"):
                reported = reported or bool(state.get("error"))
                self._local_pids.pop(r, None)
                continue
            died.append(f"rank {r} (pid {pid}{_group_of(state)}, in phase "
                        f"{state.get('phase', 'start')!r})")
        if reported or not died:
            return None, reported
        return (f"{', '.join(died)} died (killed or crashed); this rank ({self.rank}) was in "
                f"phase {self.failed_in or self.phase!r}; aborting the job"), False

    def _read_peers(self) -> dict[int, dict | None]:
        peers = {}
        for r in range(self.world_size):
            if r == self.rank:
                continue
            key = self._key(r)
            peers[r] = json.loads(self.store.get(key)) if self.store.check([key]) else None
        return peers

    def check(self, peers: dict[int, dict | None], now: float) -> tuple[str, list[dict]] | None:
        """The abort message and the silent peers' states, or None (pure given
        the peers' published states and the clock; updates what was seen)."""
        silent = []
        for r, state in peers.items():
            if state is not None and state.get("done"):
                continue
            beat = state["beat"] if state is not None else -1
            seen = self._seen.get(r)
            if seen is None or seen[0] != beat:
                self._seen[r] = (beat, now, state or {})
                continue
            if now - seen[1] > self.silence_s:
                silent.append({"rank": r, "silent_s": now - seen[1], **seen[2]})
        if silent:
            who = ", ".join(f"rank {s['rank']}" + (
                f" ({_group_of(s)[2:] + ', ' if s.get('group') else ''}last in phase "
                f"{s['phase']!r})" if "phase" in s else " (never started)") for s in silent)
            return (f"{who} silent for {max(s['silent_s'] for s in silent):.0f} s "
                    f"(collective_timeout_s={self.timeout_s:g}): "
                    f"stopped, hung or dead; this rank ({self.rank}) waits in phase "
                    f"{self.phase!r}; aborting the job", silent)
        live = {r: s for r, s in peers.items() if s is not None and not s.get("done")}
        # A peer whose beat has stopped is judged by the silence rule above (its
        # published phase may predate its stop); "different phases" is for live ones.
        beating = all(now - self._seen[r][1] <= 2 * self.interval_s for r in live)
        if now - self._progress_at > self.silence_s and beating and any(
                s["progress"] != self.progress for s in live.values()):
            where = ", ".join(f"rank {r} in {s['phase']!r} (#{s['progress']})"
                              for r, s in sorted({**live, self.rank: {
                                  "phase": self.phase, "progress": self.progress}}.items()))
            return (f"no progress for {now - self._progress_at:.0f} s "
                    f"(collective_timeout_s={self.timeout_s:g}) with "
                    f"the ranks in different phases: {where}: a collective no rank will "
                    "complete; aborting the job", [])
        return None

    def name_gone_peer(self) -> None:
        """After a collective failed on a closed connection with no dead peer on
        this host: watches the peers' beats for two beat periods (every live
        watchdog beats at least once in that time) and aborts the job naming
        those that did not beat; returns if all did."""
        def beats() -> dict[int, tuple[int, dict]]:
            return {r: (s.get("beat", -1), s) for r, s in self._read_peers().items()
                    if s is not None and not s.get("done")}

        with contextlib.suppress(Exception):  # a failing store: the traceback stands
            before = beats()
            deadline = time.monotonic() + 2 * self.interval_s + TICK_S
            while time.monotonic() < deadline and not self._aborted_elsewhere():
                time.sleep(TICK_S)
            after = beats()
            gone = [(r, s) for r, (b, s) in sorted(after.items()) if before.get(r, (None,))[0] == b]
            if self._aborted_elsewhere():
                self._exit(None, [])
            if gone:
                who = ", ".join(f"rank {r} (host {s.get('host', '?').split('/')[0]}"
                                f"{_group_of(s)}, in phase {s.get('phase', 'start')!r})"
                                for r, s in gone)
                self._exit(f"{who} closed its connections and stopped beating: it died or its "
                           f"host went down; this rank ({self.rank}) was in phase "
                           f"{self.failed_in or self.phase!r}; aborting the job", [])

    def _aborted_elsewhere(self) -> bool:
        """Whether a rank other than this one has posted an abort."""
        try:
            return bool(self.store.check([_ABORT_KEY])) and not \
                self.store.get(_ABORT_KEY).decode().startswith(f"{self.rank}:")
        except Exception:  # noqa: BLE001
            return False

    def _exit(self, msg: str | None, silent: list[dict], *, post: bool = True,
              say: bool = True) -> None:
        """Posts msg (the first rank to post prints it; without post, print it
        if say), kills silent peers on this host, cleans up, and ends this process."""
        if msg is not None:
            first = say  # a store that cannot answer cannot say another rank spoke
            if post:
                mine = f"{self.rank}:{msg}"
                with contextlib.suppress(Exception):
                    first = self.store.compare_set(_ABORT_KEY, "", mine).decode() == mine
            if first:
                print(f"error: {msg}", file=sys.stderr, flush=True)
        for s in silent:
            if s.get("host") == self._host and s.get("pid"):
                with contextlib.suppress(OSError):
                    os.kill(int(s["pid"]), signal.SIGKILL)
        for fn in _CLEANUPS:
            with contextlib.suppress(Exception):
                fn()
        os._exit(_EXIT_CODE)
