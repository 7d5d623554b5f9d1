"""Supervised warm start: a short SFT on the RL task before RL.

Job: take a (random-init) HF model folder, train it with token-level
cross-entropy on prompt -> "<answer><EOS>" examples (the demo's word problems
from its training file, templated as the RL phase templates them, or generated
"a+b=" problems) through the package's
FSDP2 trainer (`roles.trainer.Trainer`) on whatever `torch.distributed` world
is initialised (one process, or N ranks under torchrun / gloo), export it as a
HF folder (`checkpoint.export_hf`), and cache that folder so a second run
skips the training. The point is a *partly* competent policy: answers in the
right format and right often enough that RL gets a learning signal, wrong
often enough that RL has room to improve (see
`benchmarks/results/warmstart_tuning.md` for the tuned defaults).

Data: every rank builds the same `ArithmeticEnv` (task fields of
`WarmStartConfig`: its dataset file, or the generator's settings) and draws
the same global batch of `batch_size` training problems per step; rank r
trains on rows r, r + N, ... of it. The trainer normalises the loss by the
token count of the whole step over all ranks, so the update does not depend
on the rank count (up to float rounding).
Held-out prompts (`ProblemBank.eval_problems`) are never trained on.
With `tool_share` > 0 (the tool demo) the stream is `demo.tools.ToolTraces`
instead: multi-turn traces through the RL phase's own chat environment, the
loss on their sampled turns only.

Invariants:
- Cache key: the folder is `<cache_root>/warmstart-<key>`, key = a hash of the
  base folder's weights, config and tokenizer bytes, the dataset file's bytes,
  every other field of `WarmStartConfig` that changes the result, and
  `CACHE_VERSION`. A folder counts only if it
  has export_hf's COMPLETE marker (export_hf writes to a temporary folder and
  renames it, so a crash never leaves a folder that counts).
- Collective agreement: rank 0 alone decides hit or miss and broadcasts it,
  so every rank trains (or skips) together even when ranks see different
  file systems or a folder appears mid-check.
- The trainer (model, optimizer state) is freed before returning, so the RL
  phase that follows does not pay for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from hybrid_engine.demo.task import DEMO_MODEL_SPEC

if TYPE_CHECKING:
    from hybrid_engine.algorithms.losses import LossInputs
    from hybrid_engine.envs.arithmetic import ArithmeticEnv

__all__ = [
    "CACHE_VERSION",
    "DEMO_MODEL_SPEC",
    "WarmStartConfig",
    "cache_key",
    "greedy_accuracy",
    "sft_loss",
    "sft_trajectories",
    "warm_start",
    "warm_start_path",
]

CACHE_VERSION = 2
"""Bump when the training procedure changes, so old cached folders stop matching."""

log = logging.getLogger("hybrid_engine.demo.warmstart")

_NOT_IN_KEY = ("log_every", "dataset")  # not in the key as given (the dataset: by its bytes)

@dataclass(frozen=True, kw_only=True, slots=True)
class WarmStartConfig:
    """What the warm start trains on and how. Defaults: tuned for the RL demo on
    `DEMO_MODEL_SPEC`, 2 CPU cores (see benchmarks/results/warmstart_tuning.md;
    on the word-problem file 300 steps give 30% held-out accuracy and 600 gave
    89%: benchmarks/results/demo_word_problems_zen4_cpu_202611.md)."""

    steps: int = 300
    """Optimizer steps."""
    lr: float = 1e-3
    """Peak AdamW learning rate."""
    warmup_steps: int = 20
    """Linear warmup steps from 0 to lr."""
    lr_schedule: str = "constant"
    """"constant" or "cosine" (to 0 at `steps`) after warmup."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay (matrices only)."""
    grad_clip: float = 1.0
    """Max global gradient norm."""
    batch_size: int = 64
    """Problems per step over all ranks (each rank trains on its share)."""
    micro_batch_size: int | None = None
    """Rows per forward/backward on one rank; None = a rank's whole share at once."""
    compute_dtype: str = "float32"
    """Trainer forward/backward dtype ("float32" or "bfloat16"); master weights are fp32."""
    seed: int = 0
    """Seed of the training problem stream (and of nothing else: the model's
    init is the base folder's)."""
    dataset: str = ""
    """Training data file (`env.dataset_path`); "" = generated "a+b=" problems. Its
    bytes, not its path, are part of the cache key."""
    preprocess: str = ""
    """`env.preprocess` for the dataset's rows (e.g. hybrid_engine.envs.preprocess:gsm8k)."""
    chat_template: str = "none"
    """`env.chat_template`: how a prompt becomes ids, as in the RL phase."""
    min_digits: int = 1
    """Fewest digits of an operand (ArithmeticEnv)."""
    max_digits: int = 2
    """Most digits of an operand (ArithmeticEnv)."""
    operators: tuple[str, ...] = ("+",)
    """Operators drawn (ArithmeticEnv)."""
    allow_negative: bool = False
    """Allow negative results of "-" (ArithmeticEnv)."""
    stop: str = "eos"
    """What ends a target answer: "eos" (the EOS token) or "newline" ("\\n")."""
    packing: bool = False
    """Pack each micro-batch's sequences into rows (`train.packing`): no compute on
    padding, the faster on traces of mixed lengths. The word-problem demo's quoted
    warm start was made without it (another summation order: another warm start)."""
    tool_share: float = 0.0
    """The tool demo (`demo.tools.ToolTraces`): the probability that a trace calls the
    calculator before it answers; 0 = plain prompt -> answer examples."""
    copy_share: float = 0.0
    """The tool demo: round(batch_size * copy_share) more traces per step that call
    the calculator with the call's tokens out of the loss, so the model learns to
    answer from a tool's result without calling more often (0 = none)."""
    log_every: int = 50
    """Log a progress line every this many steps (rank 0); not part of the cache key."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or not self.lr > 0:
            raise ValueError(f"need steps >= 1, batch_size >= 1, lr > 0; got {self}")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(
                f"lr_schedule must be 'constant' or 'cosine', got {self.lr_schedule!r}")
        if self.stop not in ("eos", "newline"):
            raise ValueError(f"stop must be 'eos' or 'newline', got {self.stop!r}")
        if not 0.0 <= self.tool_share <= 1.0:
            raise ValueError(f"tool_share must be in [0, 1], got {self.tool_share}")
        if self.copy_share < 0 or (self.copy_share and not self.tool_share):
            raise ValueError(f"copy_share must be >= 0, and needs tool_share > 0; got "
                             f"{self.copy_share} with tool_share {self.tool_share}")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"compute_dtype must be float32 or bfloat16, got {self.compute_dtype!r}")

    def make_env(self, tokenizer: Any) -> ArithmeticEnv:
        """The task this config trains on (same seed -> same problem stream), its
        prompts formatted as in the RL phase."""
        from hybrid_engine.envs.arithmetic import ArithmeticEnv
        from hybrid_engine.envs.chat import PromptFormat
        from hybrid_engine.envs.dataset import DatasetSpec

        data = DatasetSpec(self.dataset, preprocess=self.preprocess) if self.dataset else None
        return ArithmeticEnv(
            tokenizer, seed=self.seed, dataset=data, min_digits=self.min_digits,
            max_digits=self.max_digits, operators=self.operators,
            allow_negative=self.allow_negative, prompt_format=PromptFormat(self.chat_template),
        )

    def key_fields(self) -> dict[str, Any]:
        """The fields that change the trained weights (the cache key's part)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in _NOT_IN_KEY}


# --------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------


def _hash_file(h: Any, path: Path) -> None:
    h.update(path.name.encode() + b"\0")
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)


def cache_key(base_model_dir: str | Path, cfg: WarmStartConfig) -> str:
    """Hex digest of (base weights + config bytes, cfg.key_fields(), CACHE_VERSION).

    The base folder's tokenizer files, the training data file and a chat template
    file are hashed too.
    """
    base = Path(base_model_dir)
    template = Path(cfg.chat_template)
    files = (sorted(base.glob("*.safetensors")) + [base / "config.json"]
             + sorted(base.glob("tokenizer*.json")) + ([Path(cfg.dataset)] if cfg.dataset else [])
             + ([template] if template.suffix == ".jinja" and template.is_file() else []))
    if not list(base.glob("*.safetensors")):
        raise FileNotFoundError(f"{base}: no *.safetensors weights to warm-start from")
    h = hashlib.sha256()
    for path in files:
        _hash_file(h, path)
    h.update(json.dumps({"version": CACHE_VERSION, "cfg": cfg.key_fields()},
                        sort_keys=True).encode())
    return h.hexdigest()[:16]


def warm_start_path(base_model_dir: str | Path, cache_root: str | Path,
                    cfg: WarmStartConfig) -> Path:
    """Where `warm_start` puts (or finds) the trained folder for these inputs."""
    return Path(cache_root) / f"warmstart-{cache_key(base_model_dir, cfg)}"


def _is_complete(path: Path) -> bool:
    from hybrid_engine.checkpoint import COMPLETE_MARKER

    return (path / COMPLETE_MARKER).is_file()


def _broadcast_flag(flag: bool) -> bool:
    """Rank 0's flag on every rank."""
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    t = torch.tensor([int(flag)], device=device)
    dist.broadcast(t, src=0)
    return bool(t.item())


@contextlib.contextmanager
def _process_group() -> Iterator[None]:
    """The existing default group, or a 1-process gloo group owned (and destroyed) here."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------
# Data and loss
# --------------------------------------------------------------------------


def sft_trajectories(env: ArithmeticEnv, num: int, *, stop: str = "eos") -> list:
    """The next num training problems as trajectories: prompt ids (the env's
    prompt format), response = answer ids then EOS (stop="eos") or "\\n"
    (stop="newline")."""
    from hybrid_engine.envs.base import encode
    from hybrid_engine.trajectory import Trajectory

    out = []
    for ex in env.bank.next_train(num):
        if stop == "eos":
            response = encode(env.tokenizer, ex.answer) + [env.eos_id]
        else:
            response = encode(env.tokenizer, ex.answer + "\n")
        out.append(Trajectory(prompt_ids=env.prompt_format.ids(env.tokenizer, ex.prompt),
                              response_ids=response, rollout_logp=[0.0] * len(response)))
    return out


def sft_loss(inputs: LossInputs, normalizer: Tensor | float | None = None
             ) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-mean negative log-likelihood of the response tokens (a `LossFn`).

    loss = -sum_{mask} logp / normalizer (None: this micro-batch's token
    count), so with the trainer's whole-step token count the micro-batch
    losses sum to the step's mean NLL.

    Returns:
        (loss, metrics): loss, pg_loss (= loss; the additive keys
        `combine_metrics` sums), num_tokens, num_seqs, and token_prob (mean
        probability of the target token, a token mean).
    """
    from hybrid_engine.algorithms.aggregation import aggregate_loss, masked_mean

    mask = inputs.mask_BT.bool()
    nll_BT = torch.where(mask, -inputs.logp_BT.float(), 0.0)
    loss = aggregate_loss(nll_BT, mask, "token_mean", normalizer=normalizer)
    with torch.no_grad():
        metrics = {
            "loss": loss.detach(),
            "pg_loss": loss.detach(),
            "num_tokens": mask.sum().float(),
            "num_seqs": mask.any(-1).sum().float(),
            "token_prob": masked_mean(torch.where(mask, inputs.logp_BT.detach().float(), 0.0).exp(),
                                      mask),
        }
    return loss, metrics


# --------------------------------------------------------------------------
# Warm start
# --------------------------------------------------------------------------


def warm_start(base_model_dir: str | Path, cache_root: str | Path,
               cfg: WarmStartConfig | None = None) -> Path:
    """SFT on the arithmetic task, cached: returns the trained HF folder.

    Collective over the default process group (every rank calls it with the
    same arguments); without one, a 1-process gloo group is made for the call.
    On a cache hit (a complete folder for this key, see the module docstring)
    nothing is trained and the existing folder is returned.

    Args:
        base_model_dir: HF folder to start from (weights, config, tokenizer).
        cache_root: parent folder of the cached results (created if needed).
        cfg: what to train; None = the tuned defaults.

    Returns:
        `warm_start_path(base_model_dir, cache_root, cfg)`, a complete HF folder.
    """
    cfg = cfg or WarmStartConfig()
    with _process_group():
        rank = dist.get_rank()
        out = warm_start_path(base_model_dir, cache_root, cfg)
        if _broadcast_flag(rank == 0 and _is_complete(out)):
            if rank == 0:
                log.info("warm start: cache hit %s", out)
            return out
        if rank == 0:
            Path(cache_root).mkdir(parents=True, exist_ok=True)
        _train_and_export(Path(base_model_dir), out, cfg)
        gc.collect()
    return out


def _stream(cfg: WarmStartConfig, tokenizer: Any) -> tuple[Any, int]:
    """(num -> the next num training trajectories, the pad id): the tool demo's
    traces with cfg.tool_share, else the task's prompt -> answer examples."""
    if cfg.tool_share:
        from hybrid_engine.demo.tools import ToolTraces

        traces = ToolTraces(tokenizer, dataset=cfg.dataset, preprocess=cfg.preprocess,
                            chat_template=cfg.chat_template, tool_share=cfg.tool_share,
                            copy_share=cfg.copy_share, seed=cfg.seed)
        return traces.next, traces.eos_id
    env = cfg.make_env(tokenizer)
    return (lambda n: sft_trajectories(env, n, stop=cfg.stop)), env.eos_id


def _train_and_export(base: Path, out: Path, cfg: WarmStartConfig) -> None:
    from transformers import AutoTokenizer

    from hybrid_engine.checkpoint import export_hf
    from hybrid_engine.config import ModelConfig, TrainConfig
    from hybrid_engine.roles.trainer import Trainer
    from hybrid_engine.trajectory import collate_trajectories

    rank, world = dist.get_rank(), dist.get_world_size()
    next_rows, pad_id = _stream(cfg, AutoTokenizer.from_pretrained(base))
    trainer = Trainer(
        str(base),
        # FSDP2 full sharding and padded micro-batches, as when the quoted warm start
        # was made (another layout sums in another order: another warm start).
        TrainConfig(lr=cfg.lr, weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup_steps,
                    lr_schedule=cfg.lr_schedule, grad_clip=cfg.grad_clip, num_steps=cfg.steps,
                    sharding="full", packing=cfg.packing),
        ModelConfig(master_dtype="float32", compute_dtype=cfg.compute_dtype, attention="sdpa"),
        # torch's AdamW loop, as when the quoted demo's warm start was made: the
        # fused kernel rounds differently, and 600 steps turn that into another
        # warm start (measured: held-out accuracy 0.20 at RL step 0 instead of 0.38).
        fused_adamw=False,
    )
    t0, loss_ema, metrics = time.perf_counter(), math.nan, {}
    try:
        for step in range(cfg.steps):
            rows = next_rows(cfg.batch_size)[rank::world]
            if not rows:
                raise ValueError(f"batch_size={cfg.batch_size} < world size {world}")
            batch = collate_trajectories(rows, pad_id=pad_id,
                                         micro_batch_size=cfg.micro_batch_size)
            metrics = trainer.train_step(batch, sft_loss)
            loss = metrics["loss"]
            loss_ema = loss if math.isnan(loss_ema) else 0.9 * loss_ema + 0.1 * loss
            if rank == 0 and ((step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps):
                log.info("warm start: step %d/%d loss %.4f (ema %.4f) token_prob %.3f lr %.2e "
                         "%.1fs", step + 1, cfg.steps, loss, loss_ema, metrics["token_prob"],
                         metrics["lr"], time.perf_counter() - t0)
        export_hf(out, model=trainer, hf_config_source=base)
    finally:
        del trainer
        gc.collect()
    if rank == 0:
        log.info("warm start: %d steps in %.1fs, final loss %.4f (ema %.4f) -> %s",
                 cfg.steps, time.perf_counter() - t0, metrics.get("loss", math.nan), loss_ema, out)


# --------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------


@torch.no_grad()
def greedy_accuracy(model_dir: str | Path, env: ArithmeticEnv, num_prompts: int, *,
                    max_new_tokens: int | None = None) -> float:
    """Held-out exact-match accuracy of greedy decoding, plain transformers, one process.

    Prompts of equal length are decoded together (no padding, so no position
    or mask subtleties); a completion ends at EOS or after max_new_tokens.

    Args:
        model_dir: HF folder.
        env: the task; its `eval_prompts(num_prompts)` are scored with `env.score`.
        num_prompts: held-out prompts to evaluate.
        max_new_tokens: None = the longest possible answer + 2.

    Returns:
        Fraction of prompts whose "correct" reward component is positive.
    """
    from transformers import AutoModelForCausalLM

    from hybrid_engine.trajectory import Trajectory

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if max_new_tokens is None:
        max_new_tokens = getattr(env, "max_digits", 8) + 4
    prompts = env.eval_prompts(num_prompts)
    by_len: dict[int, list[list[int]]] = {}
    for p in prompts:
        by_len.setdefault(len(p), []).append(p)
    trajs = []
    for group in by_len.values():
        responses = _greedy(model, torch.tensor(group), max_new_tokens, env.eos_id)
        trajs += [Trajectory(prompt_ids=p, response_ids=r, rollout_logp=[0.0] * len(r))
                  for p, r in zip(group, responses)]
    env.score(trajs)
    return sum(t.reward_components["correct"] > 0 for t in trajs) / len(trajs)


def _greedy(model: torch.nn.Module, ids_BP: Tensor, max_new_tokens: int, eos_id: int
            ) -> list[list[int]]:
    """Greedy continuation of same-length prompts with the KV cache; each row cut after EOS."""
    out = model(input_ids=ids_BP, use_cache=True)
    past, steps = out.past_key_values, []
    next_B = out.logits[:, -1].argmax(-1)
    done_B = torch.zeros_like(next_B, dtype=torch.bool)
    for _ in range(max_new_tokens):
        steps.append(next_B)
        done_B |= next_B == eos_id
        if bool(done_B.all()):
            break
        out = model(input_ids=next_B[:, None], past_key_values=past, use_cache=True)
        past, next_B = out.past_key_values, out.logits[:, -1].argmax(-1)
    responses = []
    for row in torch.stack(steps, 1).tolist():
        responses.append(row[: row.index(eos_id) + 1] if eos_id in row else row)
    return responses
