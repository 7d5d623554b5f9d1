"""The CUDA lock: requirements/constraints-cuda.txt, and the check that it resolves.

`make install` on a machine with an NVIDIA GPU installs requirements/cuda.txt
(vLLM's CUDA build, which pins its torch) and requirements/dev.txt under this
lock. A CPU machine cannot install that stack, but pip can resolve it: a dry
run against the package index for Linux x86-64, CPython 3.11, reading each
wheel's metadata and downloading none (`pip install --dry-run --report`).

    python requirements/cuda_lock.py --write   # re-resolve, rewrite the lock (make lock-cuda)
    python requirements/cuda_lock.py --check   # CI: the lock resolves, and pins every package

The dry run is --isolated: it reads PyPI alone, never this machine's pip
configuration or local wheels (a CPU torch there would satisfy torch==X).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOCK = HERE / "constraints-cuda.txt"
INPUTS = [HERE / "cuda.txt", HERE / "dev.txt"]
# glibc 2.35 (Ubuntu 22.04) and older wheels; CUDA machines run Linux x86-64.
PLATFORMS = [f"manylinux_2_{v}_x86_64" for v in range(35, 4, -1)] + [
    "manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64"]
HEADER = """\
# Exact versions of every package of the CUDA environment (Linux x86-64,
# CPython 3.11), as pip resolved requirements/cuda.txt and requirements/dev.txt
# against PyPI. make install uses it as a constraints file on a machine with an
# NVIDIA GPU; CI checks that it still resolves. Regenerate with 'make lock-cuda'.
"""


def resolve(constraints: Path | None) -> dict[str, str]:
    """{name: version} of what pip would install for INPUTS (under constraints).

    Raises:
        SystemExit: pip could not resolve them (its error is printed).
    """
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "--isolated", "install", "--dry-run", "--quiet",
               "--ignore-installed", "--target", str(Path(tmp) / "t"), "--report", str(report),
               "--python-version", "3.11", "--implementation", "cp", "--only-binary=:all:",
               *[f"--platform={p}" for p in PLATFORMS]]
        cmd += [a for r in INPUTS for a in ("-r", str(r))]
        cmd += ["-c", str(constraints)] if constraints else []
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"pip could not resolve the CUDA stack:\n{done.stderr[-4000:]}")
        items = json.loads(report.read_text())["install"]
    return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in items}


def read_lock(path: Path = LOCK) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower()] = version
    return pins


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="re-resolve and rewrite the lock")
    mode.add_argument("--check", action="store_true", help="resolve under the lock (CI)")
    args = p.parse_args(argv)
    if args.write:
        found = resolve(None)
        LOCK.write_text(HEADER + "".join(f"{n}=={v}\n" for n, v in sorted(found.items())))
        print(f"{LOCK.name}: {len(found)} packages, torch {found.get('torch')}, "
              f"vllm {found.get('vllm')}")
        return 0
    found, pins = resolve(LOCK), read_lock()
    unpinned = sorted(set(found) - set(pins))
    if unpinned:
        print(f"{LOCK.name} does not pin {', '.join(unpinned)}: run 'make lock-cuda'")
        return 1
    print(f"ok: {LOCK.name} resolves ({len(found)} packages, torch {found['torch']}, "
          f"vllm {found['vllm']}; nothing downloaded)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
