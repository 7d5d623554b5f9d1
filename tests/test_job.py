"""An earlier job's unfinished folders in output_dir (output_dir.sweep_unfinished):
`.tmp-` folders of a save or export cut short are removed at the next start; a
previous checkpoint moved aside (`.old-`) by a commit that died between its two
renames is moved back, never removed."""

from __future__ import annotations

from pathlib import Path

from hybrid_engine.output_dir import sweep_unfinished


def _folder(p: Path) -> Path:
    p.mkdir(parents=True)
    (p / "COMPLETE").write_text("ok\n")
    return p


def test_unfinished_folders_go_and_a_moved_aside_checkpoint_comes_back(tmp_path) -> None:
    out = tmp_path / "run"
    ck = out / "checkpoints"
    _folder(ck / "step_00000002")
    _folder(ck / "step_00000003.tmp-abc")  # a save killed before its commit
    _folder(ck / "step_00000002.old-def")  # replaced: step_00000002 exists, so stale
    _folder(ck / "step_00000001.old-ghi")  # died between the renames: the only copy
    _folder(out / "final.tmp-123")  # an export killed half-way
    _folder(out / "final")
    sweep_unfinished(out)
    assert sorted(p.name for p in ck.iterdir()) == ["step_00000001", "step_00000002"]
    assert (ck / "step_00000001" / "COMPLETE").is_file()
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "final"]


def test_nothing_to_sweep(tmp_path) -> None:
    sweep_unfinished(tmp_path / "missing")  # no error


def _files(out: Path) -> list[tuple[str, bytes]]:
    return sorted((str(p.relative_to(out)), p.read_bytes() if p.is_file() else b"")
                  for p in out.rglob("*") if p.name != ".lock")


def test_overwrite_keeps_the_earlier_run_until_the_new_job_has_started(tmp_path) -> None:
    """--overwrite moves the earlier outputs aside; a job that fails to start (a
    tracker that will not log in, after the engine) puts them back over what it
    wrote, one that dies does at the next start, and one that starts drops them."""
    from hybrid_engine.output_dir import OutputDir

    out = tmp_path / "run"
    _folder(out / "checkpoints" / "step_00000002")
    _folder(out / "final")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    before = _files(out)
    failed = OutputDir(out)
    failed.clear()
    assert not (out / "final").exists()
    (out / "metrics.jsonl").write_text("")  # the failed job's own start
    failed.unlock(remove_if_unused=True)
    assert _files(out) == before
    died = OutputDir(out)
    died.clear()  # then SIGKILL: the lock goes with the process
    died._lock.close()
    sweep_unfinished(out)
    assert _files(out) == before and not (out / ".overwritten").exists()
    started = OutputDir(out)
    started.clear()
    started.drop_cleared()
    started.unlock()
    assert sorted(p.name for p in out.iterdir()) == [".lock"]
