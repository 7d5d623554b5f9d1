"""Runs every benchmark and writes one dated report: benchmarks/results/<yyyy-mm-dd>.md
with a headline table (every ratio with its bootstrap 95% CI and the jobs
behind it, the floor or peak beside each figure), then each script's table,
the command, versions, machine and PNG charts.

    python benchmarks/report.py            # = hybrid-engine bench all = make bench
    python benchmarks/report.py --quick    # small settings (a smoke test, minutes)

Every number in the report comes from the scripts run by this invocation;
each script's own result file (and chart) lands in the same folder. The
README quotes the headline table of the newest report verbatim
(tests/benchmarks/test_report.py checks it); docs/benchmarks.md explains it.
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
    ("bench_lora.py", ["--jobs", "2"], ["--quick"]),
    ("bench_vocab.py", [], ["--quick"]),
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
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
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
                              ("naive_bucketed_s", "naive bucketed (bf16 all_gather, 256 MiB)", "s--"),
                              ("ours_s", "ours (reshard + re-pack)", "o-"),
                              ("floor_s", "floor (bytes / measured bandwidth)", "k:")):
        if all(key in r for r in rows):
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


def _ci(pair) -> str:
    return f"[{pair[0]:.2f}, {pair[1]:.2f}]"


def _sync_row(r: dict) -> str:
    naive = min(("naive", "naive_bucketed"), key=lambda k: r[f"{k}_s"])
    return (f"| weight sync, {r['model_params'] / 1e6:.0f}M, N={r['world_size']}, T={r['tp']}, "
            f"fp32 -> bf16 (`bench_sync`) | whole sync {r['ours_s']:.3f} s = "
            f"**{r['ours_s'] / r['floor_s']:.2f}x** the floor {_ci(r['ours_over_floor_ci'])} "
            f"(transfer {r['transfer_s']:.3f} s, {r['transfer_s'] / r['floor_s']:.2f}x; vLLM-CPU "
            f"re-pack {r['repack_s']:.3f} s); the faster naive ({naive}, {r[naive + '_s']:.3f} s) "
            f"is **{r[naive + '_s'] / r['ours_s']:.2f}x** slower {_ci(r['best_naive_over_ours_ci'])}"
            f"; bytes received per rank {r['bytes_received_per_rank'] / 1e6:.1f} MB (the minimum) "
            f"vs {r['naive_bucketed_bytes_received_per_rank'] / 1e6:.1f} MB bucketed naive "
            f"| floor {r['floor_s']:.3f} s: bytes / measured all_to_all + pack and write at the "
            f"measured copy rate | {r['jobs']} x {r['repeats']} |")


def _step_row(r: dict) -> str:
    return (f"| RL step, {r['model_params'] / 1e6:.0f}M, N={r['world_size']} {r['placement']} "
            f"(`bench_step`, {r['tokens_per_step']['generated']:.0f} generated tokens per step) "
            f"| **{r['step_s']:.2f} s** per step (IQR {r['step_s_iqr']:.2f}): generate "
            f"{r['generate_s']:.2f}, train {r['train_s']:.2f}, sync {r['sync_s']:.3f} s; "
            f"{r['generated_tok_s']:.0f} generated tok/s | train MFU {r['train_mfu']:.2f} of the "
            f"measured {r['matmul_peak_flops'] / 1e9:.0f} GFLOP/s matmul peak per rank "
            f"| {r['jobs']} x {r['steps_timed_per_job']} |")


def _rollout_row(r: dict) -> str:
    return (f"| generation, colocated engine vs the engine alone, {r['model_params'] / 1e6:.0f}M, "
            f"N={r['nproc']}, T={r['tp']}, KV {r['kv_tokens']['colocated']} vs "
            f"{r['kv_tokens']['standalone']} tokens (`bench_rollout`) "
            f"| colocated/standalone tok/s **{r['paired_ratio']:.3f}** {_ci(r['ratio_ci'])} "
            f"| KV budget: what the device budget leaves beside the trainer state "
            f"| {r['jobs']} x {r['repeats']} |")


def _memory_row(r: dict) -> str:
    peaks = r["whole_step_peak_mb"]
    parts = "; ".join(f"{k} {v:.0f} MB" for k, v in peaks.items())
    return (f"| whole-step peak RSS per rank, {r['model_params'] / 1e6:.0f}M, N={r['nproc']} "
            f"(`bench_memory`) | {parts} | KV cache sized to the workload: "
            f"{r['kv_cache_mb']:.1f} MB per rank | {r['jobs']} x 1 step |")


def _kernels_row(r: dict) -> str:
    rows = r["results"]["cpu"]
    sync = [rows[k] for k in ("pack", "unpack_rows", "unpack_cols")]
    lo = min(x["kernel_over_copy_ci"][0] for x in sync)
    hi = max(x["kernel_over_copy_ci"][1] for x in sync)
    each = ", ".join(f"{x['workload']} {x['kernel_over_copy']:.2f}" for x in sync)
    return (f"| copy_blocks at a sync's pack/unpack, CPU (`bench_kernels`) | {each} "
            f"of a plain copy_ of the same bytes (CIs within [{lo:.2f}, {hi:.2f}]) "
            f"| floor: `copy_` of flat tensors, {sync[0]['copy_gbps']:.0f} GB/s on pack "
            f"| {r['jobs']} x {r['repeats']} |")


def _lora_row(r: dict) -> str:
    rows, ratios = r["rows"], r["ratios"]
    parts = "; ".join(f"{m} sync {x['sync_s']['median']:.3f} s, {x['sync_bytes'] / 1e6:.1f} MB, "
                      f"{x['tok_s']['median']:.0f} tok/s, {x['peak_rss']['median'] / 2**20:.0f} MB"
                      for m, x in rows.items())
    extra = "".join(f"; {k} **{v['ratio']:.2f}** {_ci(v['ci'])}" for k, v in ratios.items()
                    if k in ("merge/adapter sync_s", "merge/adapter tok_s"))
    return (f"| LoRA rank {r['lora_rank']}, {r['model_params'] / 1e6:.0f}M, N={r['nproc']}, "
            f"T={r['tp']} (`bench_lora`) | {parts}{extra} | bytes: the planner's minimum "
            f"| {r['jobs']} x {r['repeats']} |")


def _vocab_row(r: dict) -> str:
    res = r["results"]
    parts = "; ".join(
        f"{d}: peak {x['fused']['peak_chunks']:.2f} vs {x['autograd']['peak_chunks']:.2f} fp32 "
        f"chunks, time **{x['fused_over_autograd_s']['ratio']:.2f}** "
        f"{_ci(x['fused_over_autograd_s']['ci95'])} of autograd's" for d, x in res.items())
    floor = "; ".join(f"{d} {x['fused']['over_floor']:.2f}x" for d, x in res.items())
    return (f"| vocabulary step, fused vs checkpointed autograd, N {r['tokens']}, H {r['hidden']}, "
            f"V {r['vocab']} (`bench_vocab`) | {parts} | fused over the GEMM floor: {floor} "
            f"| {r['jobs']} x {r['repeats']} |")


HEADLINES = (("sync", _sync_row), ("step", _step_row), ("rollout", _rollout_row),
             ("memory", _memory_row), ("kernels", _kernels_row), ("lora", _lora_row),
             ("vocab", _vocab_row))


def headline(summary: dict[str, dict]) -> str:
    """The report's headline table from each script's last JSON line (a row
    that cannot be built says which key it lacked instead of guessing)."""
    lines = ["| what | figure (median; ratio [bootstrap 95% CI]) | floor or peak | jobs x repeats |",
             "|---|---|---|---|"]
    for key, row in HEADLINES:
        if key not in summary:
            continue
        try:
            lines.append(row(summary[key]))
        except (KeyError, TypeError, IndexError) as e:
            lines.append(f"| {key} | (no headline: result lacks {e}) | | |")
    return "\n".join(lines)


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
        f"## Headline\n\n{headline(summary)}\n\n" + "\n".join(sections))
    print(f"[report] wrote {report} in {total / 60:.1f} min", file=sys.stderr)
    print(json.dumps({"report": str(report), "minutes": total / 60, **summary}))


if __name__ == "__main__":
    main()
