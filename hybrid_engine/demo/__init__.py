"""`hybrid-engine demo` (`make demo`): a tiny model learns word problems with RL on the local CPU cores.

What it does, on 2 ranks by default (it re-launches itself under torchrun):
1. writes the task as GSM8K-shaped parquet files, a training file and a
   separate test file (`demo/task.py`), and a random-init tiny Qwen2 folder
   (weights + a tokenizer with a ChatML chat template),
2. a short supervised warm start on the training file (`demo/warmstart.py`),
   cached under --cache-dir so a second run skips it,
3. GRPO through the hybrid engine (`job.Job`: vLLM rollout with tensor
   parallelism over the ranks, FSDP2 training, resharded weight sync) the way
   a user's GSM8K run goes: the parquet files through `datasets`, the gsm8k
   preprocessor, the chat template, and the `math` reward with a small `format`
   bonus; held-out greedy accuracy on the test file at step 0 and every few
   steps, for at most --minutes of wall time.

`--task tools` runs the tool demo instead (`demo/tools.py`): 3-4 digit
additions the model cannot do alone, the built-in calculator it can call in
the hermes format through its chat template, a warm start on a few tool-call
traces, and RL on two-turn episodes (env.name=tools).

Outputs under --output-dir: metrics.jsonl, tb/ (TensorBoard), metrics.png
(reward and accuracy over steps), final/ (the trained policy as a HF folder),
checkpoints/. The last stdout line is JSON with acc_start, acc_end (and for the
tool demo tool_calls_start and tool_calls_end: held-out calls per episode), steps,
wall_s (the RL phase), output_dir and more.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

__all__ = ["TASKS", "add_arguments", "demo_config", "demo_spec", "relaunch_argv", "run"]



TASKS = ("word_problems", "tools")
"""What `--task` picks: GSM8K-shaped additions answered at once, or with a calculator."""

TOOL_WARM_START = {"tool_share": 0.3, "copy_share": 0.5, "steps": 400, "packing": True}
"""The tool demo's warm start: 30% of its traces call the calculator (then copy its
result), half a batch more teach the copy alone; packed micro-batches."""


def demo_spec(task: str = "word_problems"):  # noqa: ANN201 - a TinyModelSpec (lazy: fast --help)
    """The demo's model: `task.DEMO_MODEL_SPEC` (a 4.1M-parameter Qwen2), or
    for the tool demo the same with the tool-call words (`tools.TOOL_MODEL_SPEC`)."""
    if task == "tools":
        from hybrid_engine.demo.tools import TOOL_MODEL_SPEC

        return TOOL_MODEL_SPEC
    from hybrid_engine.demo.task import DEMO_MODEL_SPEC

    return DEMO_MODEL_SPEC


def _demo_task(task: str):  # noqa: ANN202 - a DemoTask
    from hybrid_engine.demo.task import DemoTask

    if task == "tools":
        from hybrid_engine.demo.tools import TOOL_TASK

        return TOOL_TASK
    return DemoTask()


def _template(cache: str | Path, task: str) -> str:
    """The chat template setting: the tokenizer's, or the tool demo's file."""
    return str(Path(cache) / "hermes_names.jinja") if task == "tools" else "auto"


_PREPROCESS = "hybrid_engine.envs.preprocess:gsm8k"


def _warm_start_config(train_file: str, warm_start_steps: int | None = None,  # noqa: ANN202
                       task: str = "word_problems", template: str = "auto"):
    """The warm start's config: the RL phase's training file, preprocessor and template."""
    from hybrid_engine.demo.warmstart import WarmStartConfig

    fields = dict(TOOL_WARM_START) if task == "tools" else {}
    if warm_start_steps is not None:
        fields["steps"] = warm_start_steps
    return WarmStartConfig(dataset=train_file, preprocess=_PREPROCESS, chat_template=template,
                           **fields)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", choices=TASKS, default="word_problems",
                   help="word_problems (default): 1-2 digit additions answered at once; tools: "
                        "3-4 digit additions with a calculator the model learns to call")
    p.add_argument("--nproc", type=int, default=2, help="ranks to start under torchrun (default 2)")
    p.add_argument("--output-dir", default="runs/demo", help="run folder (default runs/demo)")
    p.add_argument("--cache-dir", default=".cache/demo",
                   help="where the base model and the warm start are cached (default .cache/demo)")
    p.add_argument("--minutes", type=float, default=9.0,
                   help="wall-time limit of the RL phase (default 9)")
    p.add_argument("--steps", type=int, default=200,
                   help="RL steps (default 200; the cosine LR schedule ends there)")
    p.add_argument("--warm-start-steps", type=int, default=None,
                   help="supervised warm-start steps (default: WarmStartConfig's, 300)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override on top of the demo's recipe, repeatable, e.g. "
                        "--set train.ppo_epochs=2, or as `train` takes it: --train.ppo_epochs=2 "
                        "(keys as `hybrid-engine config` lists them)")
    p.add_argument("--verbose", action="store_true",
                   help="every library's log on every rank, and torchrun's own log on stderr")


def run(args: argparse.Namespace) -> int:
    """Re-launches itself under torchrun unless already launched, then runs."""
    from hybrid_engine.demo.task import task_paths
    from hybrid_engine.parallel.dist import is_launched

    if not is_launched():
        try:  # bad --set items fail here, in one line, before any rank starts
            data = tuple(str(p) for p in task_paths(args.cache_dir, _demo_task(args.task)))
            demo_config("model", args.output_dir, world=args.nproc, minutes=args.minutes,
                        steps=args.steps, data=data, overrides=args.overrides, task=args.task,
                        template=_template(args.cache_dir, args.task))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return _relaunch(args)
    return _rank_main(args)


def _relaunch(args: argparse.Namespace) -> int:
    from hybrid_engine.launch import launch_local

    return launch_local(args.nproc, relaunch_argv(args), verbose=args.verbose)


def relaunch_argv(args: argparse.Namespace) -> list[str]:
    """What each rank runs: this command with the same options."""
    argv = ["-m", "hybrid_engine.cli", "demo", f"--task={args.task}",
            f"--output-dir={args.output_dir}", f"--cache-dir={args.cache_dir}",
            f"--minutes={args.minutes}", f"--steps={args.steps}"]
    if args.warm_start_steps is not None:
        argv.append(f"--warm-start-steps={args.warm_start_steps}")
    return argv + [f"--set={item}" for item in args.overrides]


def demo_config(model_path: str, output_dir: str, *, world: int, minutes: float, steps: int,  # noqa: ANN201
                data: tuple[str, str] = ("", ""), overrides: list[str] | tuple[str, ...] = (),
                task: str = "word_problems", template: str = "auto"):
    """The RL phase's RunConfig (recipe tiny_grpo_demo, the tool demo's settings for
    task="tools" (`tools.rl_overrides`, template: its template file), this run's
    paths and limits, then the user's KEY=VALUE overrides); data: the (train, test)
    files."""
    from hybrid_engine.config import apply_overrides
    from hybrid_engine.config.recipes import get_recipe

    cfg = apply_overrides(get_recipe("tiny_grpo_demo"), {
        "model.path": model_path, "output_dir": output_dir,
        "rollout.tensor_parallel_size": world, "max_wall_s": minutes * 60,
        "train.num_steps": steps, "env.dataset_path": data[0],
        "env.eval_dataset_path": data[1], "env.preprocess": _PREPROCESS,
    })
    if task == "tools":
        from hybrid_engine.demo.tools import rl_overrides

        cfg = apply_overrides(cfg, rl_overrides(template))
    return apply_overrides(cfg, list(overrides)) if overrides else cfg


def _base_model_and_task(cache: Path, rank: int, task: str) -> tuple[Path, tuple[str, str]]:
    """The random-init model folder (one per spec) and the task's (train, test)
    files (and the tool demo's template file), written once by rank 0."""
    import dataclasses

    import torch.distributed as dist

    from hybrid_engine.demo.task import task_files, task_paths
    from hybrid_engine.models.tiny import write_tiny_model

    spec = demo_spec(task)
    key = hashlib.sha256(json.dumps(dataclasses.asdict(spec), sort_keys=True).encode()).hexdigest()
    path = cache / f"base-{key[:12]}"
    if rank == 0:
        if not (path / "model.safetensors").is_file():
            tmp = cache / f".base-{key[:12]}.tmp-{os.getpid()}"
            write_tiny_model(tmp, spec)
            os.replace(tmp, path)
        task_files(cache, _demo_task(task))
        if task == "tools":
            from hybrid_engine.demo.tools import template_file

            template_file(cache)
    dist.barrier()
    return path, tuple(str(p) for p in task_paths(cache, _demo_task(task)))


def _step_s_median(history: list[dict]) -> float | None:
    """Median wall seconds per RL step: differences of consecutive steps' ends
    (the first step's end counts from the RL phase's start)."""
    import statistics

    ends = [0.0] + [h["elapsed_s"] for h in history if h.get("step", 0) > 0 and "elapsed_s" in h]
    walls = [b - a for a, b in zip(ends, ends[1:])]
    return round(statistics.median(walls), 3) if walls else None


def _rank_main(args: argparse.Namespace) -> int:
    import logging

    import torch.distributed as dist

    from hybrid_engine.parallel.dist import init_distributed
    from hybrid_engine.console import configure_logging
    from hybrid_engine.job import Job
    from hybrid_engine.demo.warmstart import warm_start

    configure_logging()
    init_distributed()
    log = logging.getLogger("hybrid_engine.demo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cache = Path(args.cache_dir)
    if rank == 0:
        cache.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    base, data = _base_model_and_task(cache, rank, args.task)
    template = _template(cache, args.task)
    warm = warm_start(base, cache, _warm_start_config(data[0], args.warm_start_steps, args.task,
                                                      template))
    warm_s = time.perf_counter() - t0
    log.info("warm-started policy: %s (%.1f s)", warm, warm_s)
    cfg = demo_config(str(warm), args.output_dir, world=world, minutes=args.minutes,
                      steps=args.steps, data=data, overrides=args.overrides, task=args.task,
                      template=template)
    job = Job(cfg, overwrite=True)  # a repeated `make demo` starts over
    try:
        summary = job.run()
    finally:
        job.shutdown()  # vLLM's teardown; it ends the process group too
    if rank == 0:
        result = {
            "acc_start": summary.get("acc_start"), "acc_end": summary.get("acc_end"),
            "steps": summary["steps"], "wall_s": round(summary["wall_s"], 1),
            "output_dir": summary["output_dir"], "stop_reason": summary["stop_reason"],
            "warm_start_s": round(warm_s, 1), "world_size": world,
            "step_s_median": _step_s_median(summary["history"]),
            "plot": str(Path(summary["output_dir"]) / "metrics.png"),
            "final_model": summary["final_model"],
        }
        calls = [h["eval/tool/calls"] for h in summary["history"] if "eval/tool/calls" in h]
        if calls:  # the tool demo: held-out tool calls per episode, first and last eval
            result.update(tool_calls_start=calls[0], tool_calls_end=calls[-1])
        print(json.dumps(result), flush=True)
    return 0
