"""The watchdog's verdicts, on a real in-memory store with a clock we choose
(the end-to-end case, a SIGSTOPped rank under torchrun, is in tests/test_faults.py)."""

from __future__ import annotations

import json

import torch.distributed as dist

from hybrid_engine.parallel import watchdog
from hybrid_engine.parallel.watchdog import Watchdog


def _dog(timeout_s: float = 20.0) -> Watchdog:
    # No thread: the test drives check() and judge_dead() itself.
    wd = Watchdog(0, 3, timeout_s, interval_s=1000.0, store=dist.HashStore(), thread=False)
    wd.silence_s = timeout_s
    return wd


def _state(beat: int, progress: int = 4, phase: str = "generate") -> dict:
    return {"beat": beat, "phase": phase, "progress": progress, "pid": 1, "host": "h"}


def test_a_peer_whose_beat_stops_is_named_with_its_phase() -> None:
    wd = _dog()
    wd.progress = 4
    assert wd.check({1: _state(0), 2: _state(0, phase="train")}, now=0.0) is None
    assert wd.check({1: _state(5), 2: _state(0, phase="train")}, now=15.0) is None
    verdict = wd.check({1: _state(6), 2: _state(0, phase="train")}, now=21.0)
    assert verdict is not None
    msg, silent = verdict
    assert [s["rank"] for s in silent] == [2]  # rank 1 kept beating
    assert msg.startswith("rank 2 (last in phase 'train') silent for 21 s "
                          "(collective_timeout_s=20)")
    assert "this rank (0) waits in phase 'build'" in msg
    wd.close()


def test_a_peer_that_never_starts_or_is_done_is_judged_right() -> None:
    wd = _dog()
    assert wd.check({1: None, 2: {"done": True}}, now=0.0) is None
    msg, _ = wd.check({1: None, 2: {"done": True}}, now=30.0)
    assert msg.startswith("rank 1 (never started) silent") and "rank 2" not in msg
    wd.close()


def test_no_progress_aborts_only_when_the_ranks_disagree() -> None:
    wd = _dog()
    wd.enter("sync")
    wd._progress_at = 0.0
    same = {1: _state(1, progress=wd.progress, phase="sync"),
            2: _state(1, progress=wd.progress, phase="sync")}
    assert wd.check(same, now=0.0) is None
    same = {r: {**s, "beat": 2} for r, s in same.items()}
    assert wd.check(same, now=100.0) is None  # all in one long phase: working
    behind = {**same, 2: _state(3, progress=wd.progress - 1, phase="train")}
    msg, silent = wd.check(behind, now=101.0)
    assert silent == [] and msg.startswith("no progress for 101 s")
    assert "rank 0 in 'sync'" in msg and "rank 2 in 'train'" in msg
    wd.close()


def test_a_stopped_peer_is_named_silent_not_as_a_phase_disagreement() -> None:
    """A SIGSTOPped peer's last published phase may predate its stop, so the
    ranks look in different phases; while its beat is stalled the watchdog
    waits for the silence verdict, which names it (a CI run once got the
    phase-disagreement line instead)."""
    wd = _dog()
    wd.interval_s = 1.0  # the thread still sleeps its first 1000 s period
    wd.enter("save")
    wd._progress_at = -5.0  # rank 0 entered 'save' 5 s before rank 2's last beat was seen
    assert wd.check({1: _state(1, progress=wd.progress, phase="save"),
                     2: _state(1, progress=wd.progress - 1, phase="build")}, now=0.0) is None
    # rank 1 beats on; rank 2 stopped at beat 1, one phase behind
    assert wd.check({1: _state(30, progress=wd.progress, phase="save"),
                     2: _state(1, progress=wd.progress - 1, phase="build")}, now=16.0) is None
    msg, silent = wd.check({1: _state(31, progress=wd.progress, phase="save"),
                            2: _state(1, progress=wd.progress - 1, phase="build")}, now=21.0)
    assert [s["rank"] for s in silent] == [2]
    assert msg.startswith("rank 2 (last in phase 'build') silent for 21 s")
    wd.close()


def test_phase_marks_and_restores_and_close_says_done() -> None:
    store = dist.HashStore()
    wd = Watchdog(1, 2, 20.0, interval_s=1000.0, store=store)
    watchdog._ACTIVE = wd
    try:
        with watchdog.phase("train"):
            assert (wd.phase, wd.progress) == ("train", 1)
        assert (wd.phase, wd.progress) == ("build", 2)
    finally:
        watchdog._ACTIVE = None
        wd.close()
    assert json.loads(store.get("hybrid_engine/watchdog/1")) == {"done": True}
    with watchdog.phase("train"):  # no watchdog: a no-op
        pass


def test_a_dead_peer_is_named_with_its_phase_and_a_reported_one_is_not() -> None:
    wd = _dog()
    wd.enter("sync")
    msg, reported = wd.judge_dead({2: 4321}, {2: _state(3, phase="sync")})
    assert not reported
    assert msg == ("rank 2 (pid 4321, in phase 'sync') died (killed or crashed); this rank (0) "
                   "was in phase 'sync'; aborting the job")
    wd.failed_in = "train"  # an exception left 'train' (the phase then restored)
    assert "this rank (0) was in phase 'train'" in wd.judge_dead({2: 1}, {2: _state(3)})[0]
    # A peer that printed its own error and left: no second line, this rank leaves too.
    assert wd.judge_dead({1: 7}, {1: {"done": True, "error": "bad reward"}}) == (None, True)
    # A peer that shut down cleanly is forgotten, not mourned.
    wd._local_pids = {1: 7}
    assert wd.judge_dead({1: 7}, {1: {"done": True}}) == (None, False)
    assert wd._local_pids == {}
    wd.close()


def test_a_peer_of_a_named_group_is_named_with_it() -> None:
    """placement=grouped names each rank's group (`set_group`): a verdict on it says
    which group lost a rank; the published state carries it."""
    wd = _dog()
    msg, _ = wd.judge_dead({2: 4321}, {2: {**_state(3, phase="train"), "group": "critic"}})
    assert msg.startswith("rank 2 (pid 4321, critic group, in phase 'train') died")
    wd.check({2: {**_state(0, phase="score"), "group": "critic"}}, now=0.0)
    msg, _ = wd.check({2: {**_state(0, phase="score"), "group": "critic"}}, now=30.0)
    assert msg.startswith("rank 2 (critic group, last in phase 'score') silent for 30 s")
    wd.group = "actor+rollout"
    wd._publish()
    assert json.loads(wd.store.get(wd._key(0)))["group"] == "actor+rollout"
    wd.close()


def test_pid_alive_tells_running_from_gone_and_zombie() -> None:
    import os
    import subprocess
    import sys
    import time

    assert watchdog.pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.time() + 30
    while watchdog.pid_alive(child.pid):  # exited, not yet reaped: a zombie
        assert time.time() < deadline
        time.sleep(0.05)
    child.wait()
    assert not watchdog.pid_alive(child.pid)  # reaped: gone


def test_abort_posts_carry_the_poster_and_an_error_survives_close() -> None:
    store = dist.HashStore()
    wd = Watchdog(1, 2, 20.0, interval_s=1000.0, store=store, thread=False)
    store.set("hybrid_engine/watchdog/abort", "1:rank 0 silent")
    assert not wd._aborted_elsewhere()  # its own post
    store.set("hybrid_engine/watchdog/abort", "0:rank 1 silent")
    assert wd._aborted_elsewhere()
    watchdog._ACTIVE = wd
    try:
        watchdog.left_with_error("bad reward")
        assert json.loads(store.get("hybrid_engine/watchdog/1")) == {"done": True,
                                                                     "error": "bad reward"}
    finally:
        watchdog._ACTIVE = None
        wd.close()
    assert json.loads(store.get("hybrid_engine/watchdog/1"))["error"] == "bad reward"
    peer = Watchdog(0, 2, 20.0, interval_s=1000.0, store=store, thread=False)
    assert peer.peer_reported_error()
    peer.close()


def test_pid_1_is_the_launcher_only_when_it_is_torchrun(tmp_path) -> None:
    """A rank's parent at start: init adopts orphans (its launcher died), but in a
    container whose entrypoint is torchrun, torchrun itself is PID 1."""
    def parent(pid: int, cmdline: str | None) -> bool:
        if cmdline is not None:
            (tmp_path / str(pid)).mkdir(exist_ok=True)
            (tmp_path / str(pid) / "cmdline").write_bytes(cmdline.replace(" ", "\0").encode())
        return watchdog._looks_like_launcher(pid, proc=str(tmp_path))

    assert not parent(1, "/sbin/init splash")
    assert parent(1, "/usr/bin/python3 -m torch.distributed.run --nnodes=2 train.py")
    assert parent(1, "/usr/local/bin/torchrun --nproc_per_node=8 train.py")
    assert parent(7, "/usr/bin/python3 -m torch.distributed.run train.py")
    assert not parent(8, "/bin/bash run.sh")
    assert parent(12345, None)  # unreadable: the benefit of the doubt
    assert not watchdog._looks_like_launcher(1, proc=str(tmp_path / "none"))  # unreadable PID 1: init


def test_a_rank_that_stops_while_failing_says_it_left_with_an_error(caplog) -> None:
    """A job that fails to start shuts its engine down (stopping the watchdog) before
    the error reaches the CLI: the stop says the error, so the peers leave silently
    (not with the closed collective's traceback), and torchrun's SIGTERM to them that
    follows is no stop request worth a line."""
    import os
    import signal

    from hybrid_engine.parallel import signals

    store = dist.HashStore()
    watchdog._ACTIVE = Watchdog(0, 2, 20.0, interval_s=1000.0, store=store, thread=False)
    try:
        raise ValueError("log.trackers: wandb did not start")
    except ValueError:
        watchdog.stop()
    assert json.loads(store.get("hybrid_engine/watchdog/0")) == {
        "done": True, "error": "log.trackers: wandb did not start"}
    watchdog._ACTIVE = peer = Watchdog(1, 2, 20.0, interval_s=1000.0, store=store, thread=False)
    try:
        with signals.stop_on_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            assert signals.requested() == signal.SIGTERM  # still recorded
    finally:
        watchdog._ACTIVE = None
        peer.close()
        signals.reset()
    assert "stopping after the current step" not in caplog.text
    watchdog._ACTIVE = Watchdog(0, 2, 20.0, interval_s=1000.0, store=dist.HashStore(),
                                thread=False)
    watchdog.stop()  # no exception in flight: a clean finish
    try:
        with signals.stop_on_signals():  # no watchdog: a user's stop, said
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        signals.reset()  # the request outlives the context: later runs in this process start clean
    assert "stopping after the current step" in caplog.text


def _preflight_error_case() -> bool:
    """Rank 0 fails before any watchdog (a preflight error): rank 1, told by torchrun's
    SIGTERM, sees that its peer left with an error of its own."""
    from hybrid_engine.parallel import watchdog as wd

    if dist.get_rank() == 0:
        wd.left_with_error("env.rewards: the weight of 'math' must be a number")
    dist.barrier()
    return wd.peer_left_with_error()


def test_an_error_before_the_watchdog_reaches_the_peers() -> None:
    from hybrid_engine.testing import run_ranks

    assert run_ranks(_preflight_error_case, 2, timeout=60) == [False, True]  # rank 0: itself
