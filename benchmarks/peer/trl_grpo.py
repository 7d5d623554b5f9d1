"""The peer: TRL's GRPOTrainer with vLLM in colocate mode (vLLM inside each
trainer process), DDP, on bench_step's workloads W1/W2. Run by bench_peer.py.

Needs a Python with trl and datasets besides this project's packages (not a
dependency of hybrid_engine; benchmarks/peer/README.md says how). Launch:
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 \
        PYTHON -m torch.distributed.run --standalone --nproc_per_node=2 \
        benchmarks/peer/trl_grpo.py --model PATH ...

Prints one JSON line per optimizer step on rank 0 ({"step", "step_s", ...}) and a
final {"summary": ...} line with the median step time over the non-warm-up steps.

Work per optimizer step (W1): 4 prompts x K=4 = 16 completions over all ranks,
<= 16 new tokens each; W2: 16 x 4 = 64 completions, <= 64 tokens.

Shims (monkeypatches, nothing in site-packages is edited) are in `_shims` and
listed in benchmarks/peer/README.md.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import resource
import statistics
import sys
import time
import zlib

# prompts per step, K, max new tokens; gpu and quick: bench_gpu.py's jobs
WORKLOADS = {"w1": (4, 4, 16), "w2": (16, 4, 64), "gpu": (32, 8, 256), "quick": (4, 2, 8)}
MAIN_REPO = str(__import__("pathlib").Path(__file__).resolve().parents[2])  # the prompts' package


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local HF model folder (with tokenizer)")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="w1")
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=1, help="optimizer steps before the timed ones")
    p.add_argument("--bf16", action="store_true", help="training under bf16 autocast (fp32 master)")
    p.add_argument("--out", required=True, help="output dir (results.jsonl)")
    p.add_argument("--micro-batch", type=int, default=4,
                   help="sequences per forward/backward per rank (hybrid_engine's "
                        "train.micro_batch_size=4); the rest is gradient accumulation "
                        "inside the one optimizer step")
    p.add_argument("--vllm-tp", type=int, default=1, help="vLLM tensor parallel size (colocate)")
    p.add_argument("--vllm-dtype", default="bfloat16", help="vLLM model dtype (shim: TRL has no knob)")
    p.add_argument("--is-correction", action="store_true",
                   help="TRL's default vllm_importance_sampling_correction=True: an extra no-grad "
                        "forward per step for old log-probs (off by default: W1 has no such forward)")
    p.add_argument("--lr", type=float, default=1e-4, help="bench_step's recipe: 1e-4")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: NCCL, vLLM with CUDA graphs and TRL's own weight sync")
    return p.parse_args(argv)


# --------------------------------------------------------------------------
# Shims
# --------------------------------------------------------------------------


def _shims(args: argparse.Namespace) -> None:
    """1. vLLM engine kwargs TRL does not expose (dtype, enforce_eager).
    2. vLLM-CPU weight sync: route TRL's colocate sync through vLLM's reload path
       (on by default; PEER_RELOAD_SHIM=0 shows the unpatched failure; see README.md)."""
    import trl.generation.vllm_generation as vg

    extra = {"dtype": args.vllm_dtype, "enforce_eager": args.device == "cpu"}
    orig_llm = vg.LLM

    @functools.wraps(orig_llm)
    def llm(*a, **k):
        k.update(extra)
        return orig_llm(*a, **k)

    vg.LLM = llm

    if args.device == "cpu" and os.environ.get("PEER_RELOAD_SHIM", "1") == "1":
        orig_sync = vg.VLLMGeneration.sync_weights

        def sync_weights(self):
            if self.mode != "colocate" or self.enable_sleep_mode:
                return orig_sync(self)
            runner = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner
            runner.reload_weights(weights_iterator=iter(self._iter_named_params()),
                                  is_checkpoint_format=True)
            self.llm.reset_prefix_cache()

        vg.VLLMGeneration.sync_weights = sync_weights

    if os.environ.get("PEER_SYNC_NOOP", "0") == "1":  # negative control for the sync check only
        vg.VLLMGeneration.sync_weights = lambda self: None


# --------------------------------------------------------------------------
# Job
# --------------------------------------------------------------------------

_calls = itertools.count()
_counts = {"completions": 0, "tokens": 0, "reward_calls": 0}


def coin_flip_reward(completions, completion_ids=None, **kwargs):
    """hybrid_engine bench_step.py's reward: a coin flip hashed from a call counter
    and the completion (cheap; every group has signal)."""
    _counts["reward_calls"] += 1
    _counts["completions"] += len(completions)
    if completion_ids is not None:
        _counts["tokens"] += sum(len(c) for c in completion_ids)
    return [float(zlib.crc32(f"{next(_calls)}|{c}".encode()) % 2) for c in completions]


def _prompts(tokenizer, n: int, seed: int) -> list[str]:
    """n training prompts of hybrid_engine's ArithmeticEnv ("12+345="), plain text."""
    if MAIN_REPO not in sys.path:
        sys.path.insert(0, MAIN_REPO)
    from hybrid_engine.envs.arithmetic import ArithmeticEnv

    env = ArithmeticEnv(tokenizer, seed=seed)
    return [ex.prompt for ex in env.bank.next_train(n)]


def main(argv=None) -> None:
    args = _args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    _shims(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    n_prompts, k, max_tokens = WORKLOADS[args.workload]
    total = n_prompts * k
    if total % (world * args.micro_batch):
        raise SystemExit(f"{total} completions do not split into {world} ranks x micro-batch "
                         f"{args.micro_batch}")
    grad_accum = total // (world * args.micro_batch)
    num_steps = args.warmup + args.steps

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    prompts = _prompts(tok, n_prompts * num_steps, args.seed)
    ds = Dataset.from_list([{"prompt": p} for p in prompts])

    cfg = GRPOConfig(
        output_dir=args.out,
        # batch: one generation of `total` completions = one optimizer step
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=grad_accum,
        num_generations=k,
        max_completion_length=max_tokens,
        num_iterations=1,
        max_steps=num_steps,
        shuffle_dataset=False,
        # algorithm: GRPO, no KL, group-std advantages, token-mean loss, clip 0.2
        beta=0.0,
        loss_type="dapo",  # TRL's default: token mean over the whole step (= token_mean)
        scale_rewards="group",
        epsilon=0.2,
        vllm_importance_sampling_correction=args.is_correction,
        temperature=1.0, top_p=1.0, top_k=0,
        # optimizer: AdamW (transformers' default adamw_torch_fused), constant lr, clip 1.0
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        # precision: fp32 weights; --bf16 = autocast
        bf16=args.bf16,
        fp16=False,
        model_init_kwargs={"dtype": torch.float32},
        gradient_checkpointing=False,  # GRPOConfig defaults to True; hybrid_engine W1 has none
        # vLLM colocate
        use_vllm=True,
        vllm_mode="colocate",
        vllm_tensor_parallel_size=args.vllm_tp,
        vllm_max_model_length=128 if max_tokens <= 64 else max_tokens + 64,
        vllm_gpu_memory_utilization=0.35,  # unused on CPU when VLLM_CPU_KVCACHE_SPACE is set
        vllm_enable_sleep_mode=False,  # vLLM-CPU has no sleep mode
        # misc
        seed=args.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        ddp_backend="gloo" if args.device == "cpu" else "nccl",
        # accelerate picks MULTI_CPU (DDP over gloo) only with cpu=True; else DistributedType.NO
        use_cpu=args.device == "cpu",
    )

    out_lines: list[dict] = []

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.t_begin = self.t_prev_end = None
            self.walls: list[float] = []

        def on_step_begin(self, a, state, control, **kw):
            _counts.update(completions=0, tokens=0, reward_calls=0)
            self.t_begin = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            t = time.perf_counter()
            inner = t - self.t_begin
            wall = inner if self.t_prev_end is None else t - self.t_prev_end
            self.t_prev_end = t
            c = torch.tensor([_counts["completions"], _counts["tokens"], _counts["reward_calls"]],
                             dtype=torch.float64)
            if dist.is_initialized():
                dist.all_reduce(c)
            row = {"step": state.global_step, "step_s": round(wall, 4),
                   "begin_to_end_s": round(inner, 4), "completions": int(c[0]),
                   "completion_tokens": int(c[1]), "reward_calls_all_ranks": int(c[2]),
                   "warmup": state.global_step <= args.warmup}
            self.walls.append(wall)
            if rank == 0:
                print(json.dumps(row), flush=True)
                out_lines.append(row)

    timer = StepTimer()
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=args.model, reward_funcs=coin_flip_reward, args=cfg,
                          train_dataset=ds, processing_class=tok, callbacks=[timer])
    setup_s = time.perf_counter() - t0
    trainer.train()

    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    rss_all = [torch.zeros(1) for _ in range(world)] if dist.is_initialized() else [rss]
    if dist.is_initialized():
        dist.all_gather(rss_all, rss)
    llm = trainer.vllm_generation.llm
    if rank == 0:
        timed = timer.walls[args.warmup:]
        summary = {
            "summary": True, "workload": args.workload, "model": args.model, "world_size": world,
            "bf16": args.bf16, "vllm_dtype": args.vllm_dtype, "vllm_tp": args.vllm_tp,
            "is_correction": args.is_correction, "micro_batch": args.micro_batch,
            "grad_accum": grad_accum, "steps_timed": len(timed), "warmup": args.warmup,
            "median_step_s": round(statistics.median(timed), 4) if timed else None,
            "setup_s": round(setup_s, 2),
            "peak_rss_mib_per_rank": [round(float(x), 1) for x in rss_all],
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "trainer_model_wrapper": type(trainer.model_wrapped).__name__,
            "accelerate_distributed_type": str(trainer.accelerator.distributed_type),
            "train_param_dtype": str(next(trainer.model.parameters()).dtype),
            "vllm_model_dtype": str(llm.llm_engine.model_config.dtype),
            "vllm_enforce_eager": llm.llm_engine.model_config.enforce_eager,
            "vllm_kv_cache_bytes": llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes,
            "vllm_max_model_len": llm.llm_engine.model_config.max_model_len,
            "vllm_tp_engine": llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size,
            "torch_threads": torch.get_num_threads(),
        }
        print(json.dumps(summary), flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.jsonl"), "w") as f:
            for r in [*out_lines, summary]:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
