"""Runs every benchmark with settings that fit 30 minutes on 2 CPU cores and
writes one dated report: benchmarks/results/<yyyy-mm-dd>.md with each
script's table, the command, versions, machine and PNG charts.

    python benchmarks/report.py            # = hybrid-engine bench all = make bench
    python benchmarks/report.py --quick    # small settings (a smoke test, minutes)

Every number in the report comes from the scripts run by this invocation;
each script's own result file (and chart) lands in the same folder.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (script, full-run arguments, --quick arguments)
SUITE = (
    ("bench_sync.py", ["--sizes", "tiny", "small", "qwen2-180m", "--nproc", "2"], ["--quick"]),
    ("bench_rollout.py", [], ["--quick"]),
    ("bench_memory.py", [], ["--quick"]),
    ("bench_step.py", [], ["--quick"]),
    ("bench_kernels.py", [], ["--quick"]),
)


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="each script's --quick settings")
    p.add_argument("--out-dir", default=str(HERE / "results"), help="where results go")
    p.add_argument("--only", nargs="+", help="run only these scripts (e.g. bench_step.py)")
    return p.parse_args(argv)


def _run(script: str, extra: list[str], out_dir: Path) -> tuple[dict, float, str]:
    """Runs one script; returns (its last JSON line, seconds, its stdout)."""
    cmd = [sys.executable, str(HERE / script), *extra, f"--out-dir={out_dir}"]
    print(f"[report] {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{script} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), time.monotonic() - t0, proc.stdout


def _newest(out_dir: Path, pattern: str, since: float) -> Path | None:
    found = [p for p in out_dir.glob(pattern) if p.stat().st_mtime >= since]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def _section(md: Path | None) -> str:
    """A script's result file without its title and command lines, images re-pointed."""
    if md is None:
        return "(no result file)\n"
    lines = md.read_text().splitlines()
    body = [ln for ln in lines[1:] if not ln.startswith("Command:") and not ln.startswith("Versions:")]
    text = "\n".join(body).strip()
    return re.sub(r"```json\n.*?\n```", "", text, flags=re.S).strip() + "\n"


def _sync_chart(md: Path, path: Path) -> bool:
    """Sync seconds vs model size: ours, naive and the measured floor."""
    m = re.search(r"```json\n(.*?)\n```", md.read_text(), flags=re.S)
    if not m:
        return False
    rows = sorted(json.loads(m.group(1)), key=lambda r: r["model_params"])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["model_params"] / 1e6 for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label, style in (("naive_s", "naive (full_tensor + load_weights)", "o--"),
                              ("ours_s", "ours (reshard + re-pack)", "o-"),
                              ("floor_s", "floor (bytes / measured bandwidth)", "k:")):
        ax.plot(x, [r[key] for r in rows], style, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("model parameters (M)")
    ax.set_ylabel("seconds per sync")
    ax.set_title(f"Weight sync FSDP2 -> vLLM TP, N={rows[0]['world_size']}, T={rows[0]['tp']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> None:
    args = _args(argv)
    sys.path.insert(0, str(HERE.parent))
    from hybrid_engine.cli import env_info

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    today = datetime.date.today().isoformat()
    started, t_all = time.time(), time.monotonic()
    sections, summary = [], {}
    for script, full, quick in SUITE:
        if args.only and script not in args.only:
            continue
        if not (HERE / script).is_file():
            sections.append(f"## {script}\n\nnot present in this checkout\n")
            continue
        extra = quick if args.quick else full
        t_script = time.time()
        result, secs, _ = _run(script, extra, out_dir)
        stem = script.removeprefix("bench_").removesuffix(".py")
        md = _newest(out_dir, f"{stem}_*.md", t_script)
        cmd = f"python benchmarks/{script} {' '.join(extra)}".strip()
        text = f"## {script} ({secs:.0f} s)\n\nCommand: `{cmd}`\n\n{_section(md)}"
        if script == "bench_sync.py" and md is not None:
            chart = out_dir / f"sync_vs_size_{today}.png"
            if _sync_chart(md, chart):
                text += f"\n![sync time vs model size]({chart.name})\n"
        sections.append(text)
        summary[stem] = result
    info = env_info()
    total = time.monotonic() - t_all
    cmd = "python benchmarks/report.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report = out_dir / f"{today}.md"
    report.write_text(
        f"# Benchmark report {today}\n\n"
        f"Command: `{cmd.strip()}` (also `hybrid-engine bench all`, `make bench`); "
        f"started {datetime.datetime.fromtimestamp(started).isoformat(timespec='seconds')}, "
        f"took {total / 60:.1f} min.\n\n"
        f"Machine: {info['device']}, {info['cpu_count']} cores; torch {info['torch']}, "
        f"vLLM {info['vllm']} ({info['vllm_build']}), transformers {info['transformers']}, "
        f"hybrid_engine {info['hybrid_engine']}.\n\n"
        "Every number below was measured by this run. Comparisons inside a section use "
        "identical models, prompts, sampling parameters and seeds; the machine is shared, "
        "so compare ratios within a section, not absolute times across reports.\n\n"
        + "\n".join(sections))
    print(f"[report] wrote {report} in {total / 60:.1f} min", file=sys.stderr)
    print(json.dumps({"report": str(report), "minutes": total / 60, **summary}))


if __name__ == "__main__":
    main()
