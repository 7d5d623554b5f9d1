"""cpu_shm.sweep_orphans: removes our segments that nothing maps, keeps a segment a
live process maps, a fresh one of a live launcher (a job between creating and
mapping it), and files without our prefix; a dead launcher's segment goes at
any age; vLLM's psm_* and Python's sem.mp-* go by age. Real files, a real
mapping in a real child process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from hybrid_engine.rollout import cpu_shm

HOLDER = """
import mmap, sys
with open(sys.argv[1], "r+b") as f:
    m = mmap.mmap(f.fileno(), 0)
print("mapped", flush=True)
sys.stdin.read()
"""


def _segment(root, name: str, age_s: float):
    path = root / name
    path.write_bytes(b"\0" * 4096)
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


ME = os.getpid()  # a live launcher: only the age rule applies to its segments
NS = cpu_shm.pid_namespace()


def test_sweep_removes_only_unmapped_old_segments_with_our_prefix(tmp_path) -> None:
    orphan = _segment(tmp_path, f"he1234-{ME}-n{NS}-abcd1234--tp:0-[0-1]-cpushm_0", age_s=3600)
    live = _segment(tmp_path, f"he5678-{ME}-n{NS}-ef012345--tp:0-[0-1]-cpushm_0", age_s=3600)
    fresh = _segment(tmp_path, f"he9999-{ME}-n{NS}-00000000--tp:0-[0-1]-cpushm_0", age_s=0)
    other = _segment(tmp_path, "psm_deadbeef", age_s=3600)
    not_ours = _segment(tmp_path, "heartbeat", age_s=3600)  # "he" but not he<port>-
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(live)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "mapped"
        removed = cpu_shm.sweep_orphans(min_age_s=60, root=tmp_path)
        assert removed == [orphan.name]
        assert not orphan.exists() and live.exists() and fresh.exists() and other.exists()
        assert not_ours.exists()
    finally:
        holder.communicate("")
    # The holder has exited: its segment is an orphan now.
    assert cpu_shm.sweep_orphans(min_age_s=60, root=tmp_path) == [live.name]


def test_a_dead_launchers_fresh_segment_goes_at_once(tmp_path) -> None:
    """A relaunch right after a kill: the dead job's segments are seconds old,
    but the launcher pid in their names is gone, so the age rule does not apply."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = _segment(tmp_path, f"he1234-{gone.pid}-n{NS}-abcd1234--tp:0-[0-1]-cpushm_0", age_s=0)
    fresh = _segment(tmp_path, f"he1234-{ME}-n{NS}-abcd1234--tp:0-[0-1]-cpushm_0", age_s=0)
    # Another PID namespace's (a container sharing /dev/shm): its pids and mappings
    # are not visible from here, so neither rule applies, however old it is.
    theirs = _segment(tmp_path, f"he1234-{gone.pid}-n{NS + 1}-abcd1234--tp:0-[0-1]-cpushm_0",
                      age_s=3600)
    assert cpu_shm.sweep_orphans(min_age_s=60, root=tmp_path) == [dead.name]
    assert fresh.exists() and theirs.exists()


def test_foreign_orphans_are_vllm_ring_buffers_and_python_semaphores(tmp_path) -> None:
    for name in ("psm_0123abcd", "sem.mp-k2j3h4", f"he1234-{ME}-x", "psm_notHex", "other"):
        _segment(tmp_path, name, age_s=3600)
    _segment(tmp_path, "psm_4567ef01", age_s=0)  # too young
    removed = cpu_shm.sweep_orphans(min_age_s=60, root=tmp_path, pattern=cpu_shm.FOREIGN)
    assert sorted(removed) == ["psm_0123abcd", "sem.mp-k2j3h4"]


def test_sweep_of_other_names_takes_only_segments_changed_after_a_time(tmp_path) -> None:
    import re

    # ctime is "now" at each write/utime and cannot be set back: order the files instead.
    earlier = _segment(tmp_path, "psm_0123abcd", age_s=3600)
    ours = _segment(tmp_path, f"he1234-{ME}-n{NS}-abcd1234--tp:0-[0-1]-cpushm_0", age_s=3600)
    time.sleep(0.05)
    cutoff = time.time()
    time.sleep(0.05)
    later = _segment(tmp_path, "psm_4567ef01", age_s=3600)  # old mtime, changed after cutoff
    removed = cpu_shm.sweep_orphans(min_age_s=60, root=tmp_path,
                                    pattern=re.compile(r"psm_[0-9a-f]+"), changed_after=cutoff)
    assert removed == [later.name]
    assert earlier.exists() and ours.exists()


def test_prefix_is_unique_per_port_launcher_and_run(monkeypatch) -> None:
    monkeypatch.setenv("MASTER_PORT", "29512")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "0123456789abcdef")
    launcher = os.getppid()
    ns = os.readlink("/proc/self/ns/pid")
    assert f"[{NS}]" in ns and NS > 0
    assert cpu_shm.prefix() == f"he29512-{launcher}-n{NS}-01234567-"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # a fixed --master_port, no --standalone
    assert cpu_shm.prefix() == f"he29512-{launcher}-n{NS}-"
    monkeypatch.setattr(os, "getppid", lambda: launcher + 1)  # a relaunch on the same port
    assert cpu_shm.prefix() == f"he29512-{launcher + 1}-n{NS}-"
    assert cpu_shm._OURS.fullmatch(cpu_shm.prefix() + "vllm_shm")


def test_an_aborting_rank_unlinks_the_segments_it_maps_and_only_those(tmp_path) -> None:
    """The watchdog's cleanup: every segment of ours or vLLM's this process maps
    goes (a dead peer's among them); one it does not map, or not ours, stays.
    What is left is then visible to `leftovers` until unlinked."""
    import mmap

    since = time.time() - 1
    mapped = [_segment(tmp_path, n, age_s=0) for n in
              ("psm_0123abcd", f"he1234-{ME}-n{NS}-abcd1234--tp:0-[0-1]-cpushm_1", "other")]
    unmapped = _segment(tmp_path, "psm_4567ef01", age_s=0)
    maps = []
    for path in mapped:
        with open(path, "r+b") as f:
            maps.append(mmap.mmap(f.fileno(), 0))
    try:
        assert cpu_shm.leftovers(since, root=tmp_path) == [unmapped.name]
        removed = cpu_shm.unlink_in_use(root=tmp_path)
        assert removed == sorted([mapped[0].name, mapped[1].name])
        assert [p.exists() for p in mapped] == [False, False, True] and unmapped.exists()
    finally:
        for m in maps:
            m.close()
    assert cpu_shm.leftovers(since, root=tmp_path) == [unmapped.name]


def test_the_shm_collectives_load_the_kernel_library_vllm_loads() -> None:
    """vLLM-CPU loads the kernel library built for this CPU (vllm._C, _C_AVX512 or
    _C_AVX2, each registering torch.ops._C); asking for the shared-memory
    all-reduce before vLLM's own import must load no second one: on a
    CPU without AVX512-BF16 that aborts the process (the namespace registered
    twice)."""
    # The trainer asks first (replicate's gradient hook), then the engine starts.
    code = ("from hybrid_engine.rollout import vllm_compat; print(vllm_compat.has_shm_allreduce()); "
            "import vllm._custom_ops; print(vllm_compat.has_shm_allreduce())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, again = proc.stdout.split()[-2:]
    assert first == again, (first, again)  # the AVX2 build has none: gloo serves
