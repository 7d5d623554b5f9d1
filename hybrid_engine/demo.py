"""`hybrid-engine demo`: the main job on the local CPU cores.

What exists today: it writes a tiny random-init Qwen2 folder (weights,
config, tokenizer), starts 2 SPMD ranks under torchrun, loads the folder into
vLLM with tensor parallelism over both ranks through the package's rollout
role, and samples arithmetic prompts. The model is untrained, so completions
are noise; the RL demo (warm start, then GRPO through the hybrid engine)
replaces this when the controller lands.

Last stdout line: JSON with the run's numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path

__all__ = ["add_arguments", "run"]

_PROMPTS = ["12+35=", "7+8=", "100-1=", "42+58="]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=2, help="ranks to start under torchrun (default 2)")
    p.add_argument("--output-dir", default="runs/demo", help="where the model folder goes")
    p.add_argument("--samples", type=int, default=4, help="completions per prompt (K)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per completion")


def run(args: argparse.Namespace) -> int:
    """Re-launches itself under torchrun unless already launched, then samples."""
    from hybrid_engine.dist import is_launched

    if not is_launched():
        return _relaunch(args)
    return _rank_main(args)


def _relaunch(args: argparse.Namespace) -> int:
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.nproc}", "-m", "hybrid_engine.cli", "demo",
           f"--output-dir={args.output_dir}", f"--samples={args.samples}",
           f"--max-tokens={args.max_tokens}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.nproc))}
    return subprocess.call(cmd, env=env)


def _rank_main(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from hybrid_engine.config import RolloutConfig
    from hybrid_engine.dist import init_distributed
    from hybrid_engine.models.tiny import PRESETS, write_tiny_model
    from hybrid_engine.roles.vllm_rollout import VLLMRollout

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    owns_group = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    log = logging.getLogger("hybrid_engine.demo")
    if rank != 0:
        log.setLevel(logging.WARNING)
    with contextlib.ExitStack() as stack:
        if owns_group:
            stack.callback(lambda: dist.is_initialized() and dist.destroy_process_group())
        model_dir = Path(args.output_dir) / "tiny-qwen2"
        if rank == 0:
            write_tiny_model(model_dir, PRESETS["tiny"])
            log.info("wrote random-init model folder %s", model_dir)
        dist.barrier()
        cfg = RolloutConfig(tensor_parallel_size=world, num_samples_per_prompt=args.samples,
                            max_tokens=args.max_tokens, max_model_len=128, kv_cache_gib=1.0,
                            temperature=1.0, enforce_eager=True)
        t0 = time.perf_counter()
        rollout = VLLMRollout(str(model_dir), cfg, dtype="float32")
        stack.callback(rollout.shutdown)  # before the group goes (it destroys it)
        start_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = rollout.generate(_PROMPTS, seed=0)
        gen_s = time.perf_counter() - t0
        if rank == 0:
            tok = rollout.tokenizer
            for p, prompt in enumerate(_PROMPTS):
                text = tok.decode(out.token_ids[p * out.num_samples])
                log.info("%-8s -> %r  (mean logprob %.2f)", prompt, text,
                         sum(out.logprobs[p * out.num_samples]) / max(1, len(out.token_ids[p * out.num_samples])))
            log.info("random-init model: completions are noise until RL training lands")
            result = {
                "world_size": world, "tp": cfg.tensor_parallel_size,
                "prompts": len(_PROMPTS), "completions": len(out.token_ids),
                "tokens": out.num_tokens, "engine_start_s": round(start_s, 2),
                "generate_s": round(gen_s, 3), "tok_s": round(out.num_tokens / gen_s, 1),
                "output_dir": str(Path(args.output_dir).resolve()),
            }
    # After the engine's teardown, which logs to stdout: the JSON stays last.
    if rank == 0:
        print(json.dumps(result), flush=True)
    return 0
