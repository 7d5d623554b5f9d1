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
