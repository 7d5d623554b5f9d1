"""Run configuration: one frozen dataclass per role, nested in `RunConfig`.

Job: hold every knob of a run, validate it where it is built, and apply
dotted overrides (`train.lr=1e-6`) from YAML files and the command line.

Invariant: a `RunConfig` that exists is valid. Every section validates its
fields in `__post_init__` (types from the annotations, bounds from the field
metadata, then cross-field rules), raising `ValueError` that names the dotted
key; configs are frozen, so the only way to change one is
`dataclasses.replace` (or `apply_overrides`), which validates again.
`validate_for_run()` adds the checks that only make sense right before
launch (model.path set, dataset file present).

Adding a field is one line: `name: type = _field(default, "doc", ge=0)`.
Its doc and default then show up in `describe()`, its annotation drives
parsing of override strings, and its bounds are checked generically.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import operator
import os
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, Literal

import yaml

__all__ = [
    "AlgorithmConfig",
    "EnvConfig",
    "ModelConfig",
    "RolloutConfig",
    "RunConfig",
    "SyncConfig",
    "TrainConfig",
    "apply_overrides",
    "describe",
    "flatten",
    "from_dict",
    "help_text",
    "load_yaml",
    "parse_cli_overrides",
    "to_dict",
]

Dtype = Literal["bfloat16", "float32"]
AdvantageName = Literal["grpo", "drgrpo", "rloo", "reinforce_pp", "gae"]
LossAgg = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "constant"]

_BOUNDS = {
    "gt": (">", operator.gt),
    "ge": (">=", operator.ge),
    "lt": ("<", operator.lt),
    "le": ("<=", operator.le),
}
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_NONE = ("none", "null")
# Advantage estimators whose baseline is the other samples of the same prompt:
# with one sample per prompt every advantage is zero (or undefined for RLOO).
_GROUP_ADVANTAGES = ("grpo", "drgrpo", "rloo")


def _field(default: Any, doc: str, **bounds: float) -> Any:
    """A dataclass field carrying its doc and numeric bounds (gt/ge/lt/le).

    A dataclass type as `default` makes a nested section (default_factory).
    Bounds are skipped when the value is None (optional fields).
    """
    assert doc.strip(), "every config field needs a doc"
    assert set(bounds) <= set(_BOUNDS), f"unknown bound in {sorted(bounds)}"
    metadata = {"doc": doc, **bounds}
    if isinstance(default, type) and is_dataclass(default):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


# --------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """The policy model and the dtypes of its two layouts."""

    path: str = _field(
        "",
        "HF model id or local directory of the policy. Required to run "
        "(checked by RunConfig.validate_for_run); empty in recipes that leave it to the user.",
    )
    master_dtype: Dtype = _field(
        "float32", "dtype of the FSDP2 master weights and optimizer state."
    )
    compute_dtype: Dtype = _field(
        "bfloat16",
        "dtype of training forward/backward (FSDP2 MixedPrecisionPolicy param_dtype); "
        "gradients are reduced in master_dtype.",
    )
    rollout_dtype: Dtype = _field(
        "bfloat16", "dtype of the vLLM weights; weight sync casts master -> this."
    )
    trust_remote_code: bool = _field(
        False, "Allow custom modeling code from the model repo (HF and vLLM)."
    )

    def __post_init__(self) -> None:
        _validate_fields(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    """vLLM sampling: how many completions per prompt and how they are drawn."""

    tensor_parallel_size: int = _field(
        1, "vLLM tensor-parallel size T; must divide the world size (N/T replicas).", ge=1
    )
    num_samples_per_prompt: int = _field(
        8, "K: completions sampled per prompt (the group of group-based advantages).", ge=1
    )
    temperature: float = _field(1.0, "Sampling temperature.", gt=0)
    top_p: float = _field(1.0, "Nucleus sampling mass; 1.0 disables it.", gt=0, le=1)
    top_k: int = _field(-1, "Top-k sampling; -1 disables it.")
    max_tokens: int = _field(256, "Maximum new tokens per completion.", ge=1)
    max_model_len: int = _field(
        1024, "Maximum prompt + completion length in tokens (vLLM max_model_len).", ge=2
    )
    kv_cache_gib: float = _field(
        4.0, "KV cache size per rank in GiB (CPU: VLLM_CPU_KVCACHE_SPACE).", gt=0
    )
    seed: int = _field(0, "Base seed of vLLM sampling (per-request seeds derive from it).", ge=0)
    prompt_too_long: Literal["reject", "truncate"] = _field(
        "reject",
        "What to do with a prompt longer than max_model_len - max_tokens: "
        "'reject' raises, 'truncate' keeps its last tokens.",
    )
    enforce_eager: bool = _field(False, "Disable CUDA graphs / compilation in vLLM.")

    def __post_init__(self) -> None:
        _validate_fields(self)
        p = _prefix(self)
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"{p}top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_model_len <= self.max_tokens:
            raise ValueError(
                f"{p}max_model_len must be > {p}max_tokens={self.max_tokens} "
                f"(room for at least one prompt token), got {self.max_model_len}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Optimizer, schedule and batch shape of the FSDP2 trainer."""

    lr: float = _field(1e-6, "Peak AdamW learning rate.", gt=0)
    weight_decay: float = _field(0.0, "AdamW decoupled weight decay.", ge=0)
    betas: tuple[float, float] = _field((0.9, 0.999), "AdamW (beta1, beta2), each in [0, 1).")
    warmup_steps: int = _field(0, "Linear warmup steps from 0 to lr.", ge=0)
    lr_schedule: Literal["constant", "cosine"] = _field(
        "constant", "Learning-rate shape after warmup (cosine decays to 0 at num_steps)."
    )
    grad_clip: float = _field(1.0, "Max global gradient norm.", gt=0)
    micro_batch_size: int = _field(
        4, "Sequences per forward/backward on one rank (gradient accumulation splits).", ge=1
    )
    activation_checkpointing: bool = _field(
        False, "Recompute decoder-layer activations in backward to save memory."
    )
    num_steps: int = _field(100, "Optimizer steps (one per RL step) in the run.", ge=1)
    prompts_per_step: int = _field(
        32, "Prompts per RL step over all ranks; sequences = this * K.", ge=1
    )

    def __post_init__(self) -> None:
        _validate_fields(self)
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"{_prefix(self)}betas must each be in [0, 1), got {self.betas}")


@dataclass(frozen=True, kw_only=True, slots=True)
class AlgorithmConfig:
    """Advantage estimator and policy loss."""

    advantage: AdvantageName = _field("grpo", "Advantage estimator (registry name).")
    loss_agg: LossAgg = _field(
        "token_mean",
        "How per-token losses reduce to a scalar: mean over all tokens, per-sequence "
        "sum or mean then mean over sequences, or sum / a constant (Dr.GRPO).",
    )
    clip_low: float = _field(0.2, "PPO ratio clip below: ratio >= 1 - clip_low.", ge=0)
    clip_high: float = _field(
        0.2, "PPO ratio clip above: ratio <= 1 + clip_high (DAPO clip-higher > clip_low).", ge=0
    )
    dual_clip: float | None = _field(
        None, "Dual-clip bound c on negative advantages; None disables it.", gt=1
    )
    kl_coef: float = _field(0.0, "Weight of the KL penalty to the reference policy; 0 = off.", ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = _field(
        "k3", "KL estimator (Schulman's k1/k2/k3) of logp - ref_logp."
    )
    kl_in_reward: bool = _field(
        False, "Subtract kl_coef * KL from the reward instead of adding it to the loss."
    )
    entropy_coef: float = _field(0.0, "Weight of the entropy bonus in the loss; 0 = off.")
    tis_cap: float | None = _field(
        None,
        "Truncated importance sampling cap on pi_train / pi_rollout per token "
        "(corrects vLLM vs trainer logprob mismatch); None disables it.",
        gt=0,
    )
    gamma: float = _field(1.0, "Discount factor (GAE, REINFORCE++).", ge=0, le=1)
    lam: float = _field(1.0, "GAE lambda.", ge=0, le=1)

    def __post_init__(self) -> None:
        _validate_fields(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncConfig:
    """Weight sync from the training layout into the inference layout."""

    method: Literal["reshard", "naive"] = _field(
        "reshard",
        "'reshard' moves only the blocks each rank needs; 'naive' gathers full tensors "
        "then calls vLLM load_weights (the reference path).",
    )
    bucket_mb: float = _field(
        256.0, "Max MiB exchanged per all_to_all bucket (bounds sync peak memory).", gt=0
    )
    verify: bool = _field(
        False, "After each sync, check bit-equality with the naive path (slow; for tests)."
    )

    def __post_init__(self) -> None:
        _validate_fields(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class EnvConfig:
    """The task: where prompts come from and how completions are rewarded."""

    name: str = _field("arithmetic", "Environment registry name.")
    dataset_path: str = _field("", "Dataset file for the environment; '' = generated prompts.")
    seed: int = _field(0, "Seed of prompt generation / dataset shuffling.", ge=0)

    def __post_init__(self) -> None:
        _validate_fields(self)
        if not self.name.strip():
            raise ValueError(f"{_prefix(self)}name must be non-empty")


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """A whole run: one section per role plus the controller's own knobs."""

    model: ModelConfig = _field(ModelConfig, "Policy model and dtypes.")
    rollout: RolloutConfig = _field(RolloutConfig, "vLLM sampling.")
    train: TrainConfig = _field(TrainConfig, "FSDP2 trainer and optimizer.")
    algorithm: AlgorithmConfig = _field(AlgorithmConfig, "Advantages and loss.")
    sync: SyncConfig = _field(SyncConfig, "Weight sync trainer -> rollout.")
    env: EnvConfig = _field(EnvConfig, "Task and reward.")
    output_dir: str = _field("runs/default", "Directory for logs, metrics and checkpoints.")
    seed: int = _field(0, "Global seed (model init, prompt order).", ge=0)
    log_every: int = _field(1, "Log metrics every this many steps.", ge=1)
    eval_every: int = _field(0, "Evaluate every this many steps; 0 = never.", ge=0)
    checkpoint_every: int = _field(
        0, "Save a checkpoint every this many steps; 0 = no periodic checkpoints.", ge=0
    )
    keep_checkpoints: int = _field(2, "Keep the newest this many checkpoints.", ge=1)
    max_wall_s: float | None = _field(
        None, "Stop after this many seconds of wall time; None = no limit.", gt=0
    )
    target_reward_ema: float | None = _field(
        None,
        "Stop once the moving average of the mean training reward reaches this; "
        "None = run all num_steps.",
    )

    def __post_init__(self) -> None:
        _validate_fields(self)
        if not self.output_dir.strip():
            raise ValueError("output_dir must be non-empty")
        k = self.rollout.num_samples_per_prompt
        if self.algorithm.advantage in _GROUP_ADVANTAGES and k < 2:
            raise ValueError(
                f"rollout.num_samples_per_prompt must be >= 2 for "
                f"algorithm.advantage={self.algorithm.advantage!r} (group baseline), got {k}"
            )

    def validate_for_run(self) -> None:
        """Checks that only hold right before launch (not for recipes or tests).

        Raises:
            ValueError: model.path is empty, or env.dataset_path names no file.
        """
        if not self.model.path:
            raise ValueError("model.path is required to run: pass --model.path=<HF id or dir>")
        if self.env.dataset_path and not os.path.exists(self.env.dataset_path):
            raise ValueError(f"env.dataset_path={self.env.dataset_path!r} does not exist")


# --------------------------------------------------------------------------
# Generic validation and value conversion (driven by the annotations)
# --------------------------------------------------------------------------


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _walk_sections(cls: type, prefix: str = "") -> Iterator[tuple[str, type]]:
    """Yields (dotted prefix, section class) for cls and its nested sections."""
    yield prefix, cls
    hints = _hints(cls)
    for f in fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and is_dataclass(tp):
            yield from _walk_sections(tp, f"{prefix}{f.name}.")


@functools.cache
def _section_prefixes() -> dict[type, str]:
    """Section class -> its dotted prefix in RunConfig ('train.'), for error messages."""
    prefixes: dict[type, str] = {}
    for prefix, cls in _walk_sections(RunConfig):
        # One class per position keeps messages unambiguous; a second use of a
        # section class (e.g. a critic ModelConfig) needs a prefix per instance.
        assert cls not in prefixes, f"{cls.__name__} appears twice in RunConfig"
        prefixes[cls] = prefix
    return prefixes


def _prefix(obj: Any) -> str:
    return _section_prefixes().get(type(obj), "")


def _validate_fields(obj: Any) -> None:
    """Type-checks every field of a section against its annotation, then its bounds.

    Normalizes in place what JSON/YAML cannot express (int -> float, list -> tuple).
    """
    prefix, hints = _prefix(obj), _hints(type(obj))
    for f in fields(obj):
        key = prefix + f.name
        value = getattr(obj, f.name)
        converted = _convert(value, hints[f.name], key, parse_str=False)
        if converted is not value:
            object.__setattr__(obj, f.name, converted)
        if converted is None:
            continue
        for bound, (op, holds) in _BOUNDS.items():
            limit = f.metadata.get(bound)
            if limit is not None and not holds(converted, limit):
                raise ValueError(f"{key} must be {op} {limit}, got {converted!r}")


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("None" if a is type(None) else _type_name(a) for a in args)
    if origin is tuple:
        return f"tuple[{', '.join('...' if a is Ellipsis else _type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def _type_error(key: str, tp: Any, value: Any) -> ValueError:
    return ValueError(f"{key}: expected {_type_name(tp)}, got {value!r}")


def _convert(value: Any, tp: Any, key: str, *, parse_str: bool) -> Any:
    """Returns value as an instance of annotation tp, or raises ValueError naming key.

    parse_str=True (overrides) parses strings per tp: "1e-6" -> float,
    "true"/"0" -> bool, "none"/"null" -> None for optional fields,
    "0.9,0.95" -> tuple. parse_str=False (construction) accepts only values
    already of the right kind, widening int -> float and list -> tuple.
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (
            value is None or (parse_str and isinstance(value, str) and value.lower() in _NONE)
        ):
            return None
        inner = [a for a in args if a is not type(None)]
        assert len(inner) == 1, f"{key}: only X | None unions are supported, got {tp!r}"
        try:
            return _convert(value, inner[0], key, parse_str=parse_str)
        except ValueError:
            raise _type_error(key, tp, value) from None
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return value
        raise ValueError(f"{key} must be one of {', '.join(map(repr, args))}, got {value!r}")
    if origin is tuple:
        return _convert_tuple(value, args, tp, key, parse_str=parse_str)
    if isinstance(tp, type) and is_dataclass(tp):
        if isinstance(value, tp):
            return value
        raise _type_error(key, tp, value)
    if tp in (bool, int, float, str):
        return _convert_scalar(value, tp, key, parse_str=parse_str)
    raise AssertionError(f"{key}: unsupported annotation {tp!r}; extend _convert")


def _convert_scalar(value: Any, tp: type, key: str, *, parse_str: bool) -> Any:
    if parse_str and isinstance(value, str) and tp is not str:
        value = _parse_scalar(value.strip(), tp, key)
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = value if type(value) is float else float(value)
        if not math.isfinite(value):
            raise ValueError(f"{key} must be finite, got {value!r}")
    # bool is a subclass of int: True is not an int setting.
    if not isinstance(value, tp) or (tp is not bool and isinstance(value, bool)):
        raise _type_error(key, tp, value)
    return value


def _parse_scalar(text: str, tp: type, key: str) -> Any:
    if tp is bool:
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise _type_error(key, tp, text)
    try:
        return tp(text)
    except ValueError:
        raise _type_error(key, tp, text) from None


def _convert_tuple(value: Any, args: tuple, tp: Any, key: str, *, parse_str: bool) -> tuple:
    if isinstance(value, str) and parse_str:
        text = value.strip().strip("()[]")
        items: list[Any] = text.split(",") if text else []
    elif isinstance(value, (tuple, list)):
        items = list(value)
    else:
        raise _type_error(key, tp, value)
    if len(args) == 2 and args[1] is Ellipsis:
        elem_types = [args[0]] * len(items)
    elif len(items) == len(args):
        elem_types = list(args)
    else:
        raise _type_error(key, tp, value)
    try:
        return tuple(_convert(v, t, key, parse_str=parse_str) for v, t in zip(items, elem_types))
    except ValueError:
        raise _type_error(key, tp, value) from None


# --------------------------------------------------------------------------
# Introspection: keys, docs, dict round trip
# --------------------------------------------------------------------------


@functools.cache
def _leaf_types(cls: type) -> dict[str, Any]:
    """Dotted key -> annotation for every leaf (non-section) field of cls."""
    leaves: dict[str, Any] = {}
    for prefix, section in _walk_sections(cls):
        hints = _hints(section)
        for f in fields(section):
            tp = hints[f.name]
            if not (isinstance(tp, type) and is_dataclass(tp)):
                leaves[prefix + f.name] = tp
    return leaves


def describe(cfg: Any) -> list[tuple[str, str, str]]:
    """Lists every leaf field of a config as (dotted key, repr(value), doc).

    Args:
        cfg: a RunConfig (or any section); values shown are cfg's, so
            describe(RunConfig()) gives the defaults and describe(recipe) the
            recipe's settings.
    """
    rows: list[tuple[str, str, str]] = []
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if is_dataclass(value):
            rows += [(f"{f.name}.{k}", v, d) for k, v, d in describe(value)]
        else:
            rows.append((f.name, repr(value), f.metadata.get("doc", "")))
    return rows


def help_text(cfg: Any) -> str:
    """describe(cfg) as aligned `--key=value  doc` lines, for a CLI --help."""
    rows = describe(cfg)
    width = max(len(k) + len(v) for k, v, _ in rows) + 4
    return "\n".join(f"--{k}={v}".ljust(width) + f"  {d}" for k, v, d in rows)


def to_dict(cfg: Any) -> dict[str, Any]:
    """Nested dict of plain values (tuples as lists), safe for yaml.safe_dump / json."""
    out: dict[str, Any] = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if is_dataclass(value):
            value = to_dict(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def from_dict(d: Mapping[str, Any]) -> RunConfig:
    """Inverse of to_dict; also accepts dotted keys. Missing keys keep their defaults.

    Raises:
        ValueError: unknown key (with suggestions) or invalid value.
    """
    return apply_overrides(RunConfig(), flatten(d))


# --------------------------------------------------------------------------
# Overrides: dotted keys from YAML files and the command line
# --------------------------------------------------------------------------


def _unknown_key_error(key: str, leaves: Mapping[str, Any]) -> ValueError:
    """ValueError naming key, with the closest valid keys (section or field typos)."""
    sections = sorted({k.rsplit(".", 1)[0] for k in leaves if "." in k})
    if key in sections:
        example = next(k for k in leaves if k.startswith(key + "."))
        return ValueError(f"{key!r} is a section, not a field; set e.g. {example!r}")
    matches = difflib.get_close_matches(key, list(leaves), n=3, cutoff=0.6)
    if not matches:
        # e.g. 'lr' (section forgotten): match on the field name alone.
        leaf = key.rsplit(".", 1)[-1]
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in leaves}
        matches = [by_leaf[m] for m in difflib.get_close_matches(leaf, list(by_leaf), n=3)]
    hint = (
        "did you mean " + " or ".join(repr(m) for m in matches) + "?"
        if matches
        else f"sections are {', '.join(sections)}; describe() lists every key"
    )
    return ValueError(f"unknown config key {key!r}; {hint}")


def _split_assignment(item: str) -> tuple[str, str]:
    key, sep, value = item.removeprefix("--").partition("=")
    if not sep or not key:
        raise ValueError(f"override {item!r} must look like key=value (e.g. train.lr=1e-6)")
    return key.strip(), value


def apply_overrides(cfg: RunConfig, overrides: Mapping[str, Any] | list[str]) -> RunConfig:
    """Returns cfg with dotted-key overrides applied via dataclasses.replace.

    Args:
        cfg: the base config (e.g. a recipe).
        overrides: {"train.lr": 1e-6} (values typed, or strings to parse) or
            ["train.lr=1e-6", ...] (later entries win). Strings are parsed per
            the field's annotation; see _convert.

    Each section is rebuilt once with all its changes, so cross-field rules
    (e.g. max_model_len > max_tokens) see the final values, not an order.

    Raises:
        ValueError: unknown key (with suggestions), wrong type, or a value the
            section rejects; the message names the dotted key.
    """
    if isinstance(overrides, Mapping):
        pairs = list(overrides.items())
    else:
        pairs = [_split_assignment(item) for item in overrides]
    leaves = _leaf_types(type(cfg))
    changes: dict[str, Any] = {}
    for key, raw in pairs:
        if key not in leaves:
            raise _unknown_key_error(key, leaves)
        node = changes
        *path, name = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[name] = _convert(raw, leaves[key], key, parse_str=True)
    return _replace_nested(cfg, changes)


def _replace_nested(obj: Any, changes: Mapping[str, Any]) -> Any:
    if not changes:
        return obj
    kwargs = {
        name: _replace_nested(getattr(obj, name), value)
        if is_dataclass(getattr(obj, name))
        else value
        for name, value in changes.items()
    }
    return replace(obj, **kwargs)


def flatten(d: Mapping[str, Any], *, source: str = "config") -> dict[str, Any]:
    """Flattens nested mappings into dotted keys: {"train": {"lr": 1}} -> {"train.lr": 1}.

    Nested sections and dotted keys may be mixed; a key given twice raises
    ValueError naming source.
    """
    out: dict[str, Any] = {}

    def visit(node: Mapping[Any, Any], prefix: str) -> None:
        for k, v in node.items():
            if not isinstance(k, str):
                raise ValueError(f"{source}: keys must be strings, got {k!r} under {prefix!r}")
            key = prefix + k
            if isinstance(v, Mapping):
                visit(v, key + ".")
            elif key in out:
                raise ValueError(f"{source}: key {key!r} is set twice")
            else:
                out[key] = v

    visit(d, "")
    return out


def load_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Reads a YAML file of overrides into a flat {dotted key: value} dict.

    Raises:
        ValueError: the file is not valid YAML (with line) or its top level is
            not a mapping; the message names the file.
    """
    with open(path, encoding="utf-8") as fh:
        try:
            data = yaml.safe_load(fh)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f":{mark.line + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc)
            raise ValueError(f"{path}{where}: invalid YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ValueError(
            f"{path}: top level must be a mapping of config keys, got {type(data).__name__}"
        )
    return flatten(data, source=str(path))


def parse_cli_overrides(argv: list[str]) -> list[str]:
    """Turns ["--train.lr=1e-6", "--seed", "3"] into ["train.lr=1e-6", "seed=3"].

    Values may start with a single '-' (negative numbers) but not with '--'.

    Raises:
        ValueError: a bare argument, or a flag without a value.
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ValueError(f"unexpected argument {arg!r}; overrides look like --train.lr=1e-6")
        if "=" in arg:
            out.append(arg[2:])
            i += 1
            continue
        if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
            raise ValueError(f"{arg} needs a value ({arg}=VALUE or {arg} VALUE)")
        out.append(f"{arg[2:]}={argv[i + 1]}")
        i += 2
    return out
