"""Tests of hybrid_engine.config and hybrid_engine.config.recipes (fast, no torch work)."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest
import yaml

from hybrid_engine.config import (
    AlgorithmConfig,
    RolloutConfig,
    RunConfig,
    TrainConfig,
    apply_overrides,
    describe,
    from_dict,
    help_text,
    load_yaml,
    parse_cli_overrides,
    to_dict,
)
from hybrid_engine.config.recipes import RECIPES, build_config, get_recipe


def _all_fields(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field]]:
    """Every field of cls and of its nested sections, sections included."""
    out = []
    for f in dataclasses.fields(cls):
        out.append((prefix + f.name, f))
        if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
            out += _all_fields(f.default_factory, f"{prefix}{f.name}.")
    return out


def _cli_str(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


# --- defaults, docs, describe ------------------------------------------------


def test_defaults_validate_and_sections_are_frozen():
    cfg = RunConfig()
    cfg.__post_init__()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.lr = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 1  # type: ignore[misc]
    assert not hasattr(cfg, "__dict__")  # slots


def test_every_field_is_documented_and_described():
    documented = _all_fields(RunConfig)
    undocumented = [k for k, f in documented if not f.metadata.get("doc", "").strip()]
    assert undocumented == [], f"fields without a doc: {undocumented}"
    rows = describe(RunConfig())
    leaves = {k for k, f in documented if not dataclasses.is_dataclass(f.default_factory)}
    assert [k for k, _, _ in rows] == sorted(leaves, key=[k for k, _ in documented].index)
    assert all(doc.strip() for _, _, doc in rows)
    lr_doc = TrainConfig.__dataclass_fields__["lr"].metadata["doc"]
    assert ("train.lr", repr(TrainConfig().lr), lr_doc) in rows
    text = help_text(RunConfig())
    assert all(f"--{k}=" in text for k in leaves)


def test_field_docs_fit_two_lines():
    """A key's doc is a summary (two lines of `config --keys`); the details are in
    docs/configuration.md."""
    long = [(k, len(d)) for k, _, d in describe(RunConfig()) if len(d) > 180]
    assert long == [], f"field docs over 180 characters: {long}"


# An old key, a value other than its default, and the new keys its rules need.
_OLD_KEYS = {
    "rollout.max_staleness": (2, {"algorithm.behaviour_logp": "rollout"}),
    "rollout.ahead_schedule": ("stream", {}),
    "rollout.partial_rollout": (True, {"async_rollout.max_staleness": 1,
                                       "algorithm.behaviour_logp": "rollout",
                                       "async_rollout.step_token_budget": 100}),
    "rollout.step_token_budget": (100, {"async_rollout.partial": True,
                                        "async_rollout.max_staleness": 1,
                                        "algorithm.behaviour_logp": "rollout"}),
    "rollout.stale_partial": ("drop", {}),
    "rollout.inflight_updates": (True, {"placement": "separate",
                                        "async_rollout.max_staleness": 1,
                                        "algorithm.behaviour_logp": "rollout"}),
    "rollout.release_memory": ("true", {}),
    "rollout.memory_budget": (0.5, {}),
    "rollout.kv_cache_gib": (0.5, {}),
    "rollout.gpu_memory_fraction": (0.5, {}),
    "rollout.emulate_gpu_sleep": (True, {}),
    "train.offload_optimizer": (True, {}),
    "train.max_nonfinite_in_a_row": (7, {}),
    "mismatch_alarm": (0.1, {}),
    "mismatch_abort": (True, {}),
    "mismatch_split_sequences": (4, {}),
    "eval_every": (3, {}),
    "env.num_eval_prompts": (5, {}),
    "log_every": (4, {}),
}


def test_every_old_key_still_works_with_a_one_line_notice(monkeypatch, caplog):
    """Each key that moved to async_rollout, memory or guards still sets its new
    key (from a dict, a CLI string or nested YAML), and says once which to use."""
    from hybrid_engine.config import RENAMED_KEYS
    from hybrid_engine.config import overrides

    assert set(_OLD_KEYS) == set(RENAMED_KEYS)
    for old, (value, rules) in _OLD_KEYS.items():
        new = RENAMED_KEYS[old]
        monkeypatch.setattr(overrides, "_NOTICED", set())
        caplog.clear()
        with caplog.at_level("WARNING", logger="hybrid_engine.config.overrides"):
            via_old = apply_overrides(RunConfig(), {**rules, old: value})
            apply_overrides(RunConfig(), [f"{k}={v}" for k, v in {**rules, old: value}.items()])
        assert via_old == apply_overrides(RunConfig(), {**rules, new: value}), old
        assert {k: v for k, v, _ in describe(via_old)}[new] == repr(value), old
        notices = [r.getMessage() for r in caplog.records]
        assert notices == [f"config key {old!r} is deprecated: use {new!r}"], (old, notices)
    section, leaf = "rollout", "max_staleness"  # nested, as an old YAML file has it
    cfg = from_dict({section: {leaf: 1}, "algorithm": {"behaviour_logp": "rollout"}})
    assert cfg.async_rollout.max_staleness == 1


def test_describe_shows_the_given_configs_values():
    rows = dict((k, v) for k, v, _ in describe(get_recipe("tiny_grpo_debug")))
    assert rows["rollout.max_tokens"] == "16"
    assert rows["model.rollout_dtype"] == "'float32'"  # the recipe's, not the default


def test_no_required_field_defaults_to_none():
    # None is only ever a default of fields whose annotation allows it ("off").
    for key, f in _all_fields(RunConfig):
        if f.default is None:
            assert "None" in str(f.type), f"{key} defaults to None but is not Optional"


# --- validation --------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("train.lr", -1.0, "train.lr must be > 0, got -1.0"),
        ("train.lr", 0, "train.lr must be > 0"),
        ("train.weight_decay", -0.1, "train.weight_decay must be >= 0"),
        ("train.betas", (0.9, 1.0), "train.betas must each be in [0, 1)"),
        ("train.warmup_steps", -1, "train.warmup_steps must be >= 0"),
        ("train.replica_check_every", -1, "train.replica_check_every must be >= 0"),
        ("train.grad_clip", 0.0, "train.grad_clip must be > 0"),
        ("train.micro_batch_size", 0, "train.micro_batch_size must be >= 1"),
        ("train.num_steps", 0, "train.num_steps must be >= 1"),
        ("train.prompts_per_step", 0, "train.prompts_per_step must be >= 1"),
        ("train.lr_schedule", "linear", "train.lr_schedule must be one of 'constant', 'cosine'"),
        ("train.lr", float("inf"), "train.lr must be finite"),
        ("rollout.tensor_parallel_size", 0, "rollout.tensor_parallel_size must be >= 1"),
        ("rollout.num_samples_per_prompt", 0, "rollout.num_samples_per_prompt must be >= 1"),
        ("rollout.temperature", 0.0, "rollout.temperature must be > 0"),
        ("rollout.top_p", 1.5, "rollout.top_p must be <= 1"),
        ("rollout.top_p", 0.0, "rollout.top_p must be > 0"),
        ("rollout.top_k", 0, "rollout.top_k must be -1 (off) or >= 1"),
        ("rollout.max_tokens", 0, "rollout.max_tokens must be >= 1"),
        ("rollout.max_tokens", 5000, "rollout.max_model_len must be > rollout.max_tokens=5000"),
        ("memory.kv_cache_gib", 0.0, "memory.kv_cache_gib must be > 0"),
        ("rollout.prompt_too_long", "drop", "rollout.prompt_too_long must be one of"),
        ("rollout.seed", -1, "rollout.seed must be >= 0"),
        ("model.compute_dtype", "fp16", "model.compute_dtype must be one of 'auto', 'bfloat16', 'float32'"),
        ("model.trust_remote_code", 1, "model.trust_remote_code: expected bool"),
        ("algorithm.loss_agg", "sum", "algorithm.loss_agg must be one of"),
        ("algorithm.clip_low", -0.1, "algorithm.clip_low must be >= 0"),
        ("algorithm.clip_high", -0.1, "algorithm.clip_high must be >= 0"),
        ("algorithm.dual_clip", 1.0, "algorithm.dual_clip must be > 1"),
        ("algorithm.kl_coef", -1.0, "algorithm.kl_coef must be >= 0"),
        ("algorithm.tis_cap", 0.0, "algorithm.tis_cap must be > 0"),
        ("algorithm.gamma", 1.1, "algorithm.gamma must be <= 1"),
        ("algorithm.lam", -0.1, "algorithm.lam must be >= 0"),
        ("sync.method", "fast", "sync.method must be one of 'reshard', 'naive'"),
        ("sync.bucket_mb", 0.0, "sync.bucket_mb must be > 0"),
        ("env.name", " ", "env.name must be non-empty"),
        ("env.seed", -2, "env.seed must be >= 0"),
        ("output_dir", "", "output_dir must be non-empty"),
        ("log.every", 0, "log.every must be >= 1"),
        ("log.samples_per_table", 0, "log.samples_per_table must be >= 1"),
        ("eval.every", -1, "eval.every must be >= 0"),
        ("checkpoint_every", -1, "checkpoint_every must be >= 0"),
        ("keep_checkpoints", 0, "keep_checkpoints must be >= 1"),
        ("max_wall_s", 0.0, "max_wall_s must be > 0"),
        ("seed", 1.5, "seed: expected int, got 1.5"),
        ("train.num_steps", True, "train.num_steps: expected int, got True"),
        ("env.name", 3, "env.name: expected str, got 3"),
    ],
)
def test_invalid_values_name_the_field(key, value, message):
    with pytest.raises(ValueError) as exc:
        apply_overrides(RunConfig(), {key: value})
    assert message in str(exc.value)


def test_direct_construction_validates_with_dotted_name():
    with pytest.raises(ValueError, match=r"^train\.lr must be > 0, got -1\.0$"):
        TrainConfig(lr=-1.0)
    with pytest.raises(ValueError, match=r"rollout\.top_k"):
        RolloutConfig(top_k=-3)
    # Construction does not parse strings: only overrides do.
    with pytest.raises(ValueError, match=r"train\.lr: expected float, got '1e-6'"):
        TrainConfig(lr="1e-6")  # type: ignore[arg-type]


def test_construction_normalizes_json_shapes():
    cfg = TrainConfig(lr=1, betas=[0, 0.5])  # type: ignore[arg-type]
    assert cfg.lr == 1.0 and type(cfg.lr) is float
    assert cfg.betas == (0.0, 0.5) and type(cfg.betas) is tuple


def test_group_advantage_needs_two_samples_at_build_time():
    from hybrid_engine.algorithms.algorithm import Algorithm

    def build(cfg: RunConfig) -> Algorithm:
        return Algorithm(cfg.algorithm, num_samples=cfg.rollout.num_samples_per_prompt,
                         max_tokens=cfg.rollout.max_tokens)

    with pytest.raises(ValueError, match="algorithm.advantage='grpo' needs >= 2 samples"):
        build(apply_overrides(RunConfig(), ["rollout.num_samples_per_prompt=1"]))
    cfg = apply_overrides(
        RunConfig(), ["rollout.num_samples_per_prompt=1", "algorithm.advantage=reinforce_pp"]
    )
    assert build(cfg).k == 1


def test_related_overrides_apply_together_regardless_of_order():
    for order in (1, -1):
        pairs = ["rollout.max_tokens=4000", "rollout.max_model_len=8192"][::order]
        assert apply_overrides(RunConfig(), pairs).rollout.max_model_len == 8192


def test_validate_for_run():
    with pytest.raises(ValueError, match="model.path is required"):
        get_recipe("qwen05b_grpo").validate_for_run()
    cfg = apply_overrides(RunConfig(), ["model.path=some/model", "env.dataset_path=/nonexistent"])
    with pytest.raises(ValueError, match="env.dataset_path"):
        cfg.validate_for_run()
    apply_overrides(cfg, ["env.dataset_path="]).validate_for_run()


# --- override parsing --------------------------------------------------------


@pytest.mark.parametrize(
    "item, path, expected",
    [
        ("train.lr=1e-6", ("train", "lr"), 1e-6),
        ("train.lr=3", ("train", "lr"), 3.0),
        ("train.num_steps=7", ("train", "num_steps"), 7),
        ("sync.verify=true", ("sync", "verify"), True),
        ("sync.verify=False", ("sync", "verify"), False),
        ("sync.verify=1", ("sync", "verify"), True),
        ("sync.verify=0", ("sync", "verify"), False),
        ("model.path=Qwen/Qwen2.5-0.5B", ("model", "path"), "Qwen/Qwen2.5-0.5B"),
        ("env.dataset_path=", ("env", "dataset_path"), ""),
        ("train.lr_schedule=cosine", ("train", "lr_schedule"), "cosine"),
        ("algorithm.dual_clip=3", ("algorithm", "dual_clip"), 3.0),
        ("algorithm.dual_clip=none", ("algorithm", "dual_clip"), None),
        ("algorithm.tis_cap=NULL", ("algorithm", "tis_cap"), None),
        ("train.betas=0.9,0.95", ("train", "betas"), (0.9, 0.95)),
        ("train.betas=(0.8, 0.9)", ("train", "betas"), (0.8, 0.9)),
        ("train.betas=[0, 0.5]", ("train", "betas"), (0.0, 0.5)),
        ("algorithm.entropy_coef=-0.01", ("algorithm", "entropy_coef"), -0.01),
        ("max_wall_s=3600", ("max_wall_s",), 3600.0),
        ("seed=5", ("seed",), 5),
    ],
)
def test_string_values_parse_per_annotation(item, path, expected):
    value = apply_overrides(RunConfig(), [item])
    for name in path:
        value = getattr(value, name)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    "item, message",
    [
        ("train.lr=fast", "train.lr: expected float, got 'fast'"),
        ("train.num_steps=1.5", "train.num_steps: expected int, got '1.5'"),
        ("sync.verify=maybe", "sync.verify: expected bool, got 'maybe'"),
        ("algorithm.dual_clip=big", "algorithm.dual_clip: expected float | None, got 'big'"),
        ("train.betas=0.9", "train.betas: expected tuple[float, float], got '0.9'"),
        ("train.betas=0.9,x", "train.betas: expected tuple[float, float]"),
        ("train.lr=none", "train.lr: expected float, got 'none'"),
        ("train.lr", "must look like key=value"),
    ],
)
def test_bad_strings_name_field_and_expected_type(item, message):
    with pytest.raises(ValueError) as exc:
        apply_overrides(RunConfig(), [item])
    assert message in str(exc.value)


def test_literal_error_lists_allowed_values():
    with pytest.raises(ValueError) as exc:
        apply_overrides(RunConfig(), ["algorithm.loss_agg=sum"])
    msg = str(exc.value)
    for name in ("'token_mean'", "'seq_mean_token_sum'", "'seq_mean_token_mean'", "'constant'",
                 "'sum'"):
        assert name in msg


def test_every_field_round_trips_through_its_cli_string():
    # Guards the parser: a field with an annotation _convert cannot parse fails here.
    for cfg in [RunConfig(), *(fn() for fn in RECIPES.values())]:
        items = [f"{k}={_cli_str(v)}" for k, v in _leaf_values(cfg)]
        assert apply_overrides(RunConfig(), items) == cfg


def _leaf_values(cfg: object, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            out += _leaf_values(v, f"{prefix}{f.name}.")
        else:
            out.append((prefix + f.name, v))
    return out


@pytest.mark.parametrize(
    "key, suggestion",
    [
        ("trian.lr", "'train.lr'"),  # section typo
        ("train.lrr", "'train.lr'"),  # field typo
        ("algo.kl_coef", "'algorithm.kl_coef'"),
        ("rollout.topk", "'rollout.top_k'"),
        ("lr", "'train.lr'"),  # section forgotten
    ],
)
def test_unknown_key_suggests_closest(key, suggestion):
    with pytest.raises(ValueError) as exc:
        apply_overrides(RunConfig(), {key: 1})
    msg = str(exc.value)
    assert f"unknown config key {key!r}" in msg
    assert f"did you mean {suggestion}" in msg


def test_unknown_key_without_match_lists_sections_and_section_key_is_explained():
    with pytest.raises(ValueError, match="sections are algorithm, async_rollout, env, eval, export, guards, log, memory, model"):
        apply_overrides(RunConfig(), ["zzz=1"])
    with pytest.raises(ValueError, match="'train' is a section"):
        apply_overrides(RunConfig(), ["train=1"])


def test_parse_cli_overrides_forms():
    argv = ["--train.lr=1e-6", "--seed", "3", "--algorithm.entropy_coef", "-0.01", "--model.path="]
    assert parse_cli_overrides(argv) == [
        "train.lr=1e-6",
        "seed=3",
        "algorithm.entropy_coef=-0.01",
        "model.path=",
    ]
    with pytest.raises(ValueError, match="needs a value"):
        parse_cli_overrides(["--train.lr"])
    with pytest.raises(ValueError, match="needs a value"):
        parse_cli_overrides(["--train.lr", "--seed=1"])
    with pytest.raises(ValueError, match="unexpected argument"):
        parse_cli_overrides(["train.lr=1"])


# --- YAML, precedence, round trip ---------------------------------------------


def test_load_yaml_flattens_nested_and_dotted(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "train:\n  lr: 1e-5\n  betas: [0.9, 0.95]\nrollout.max_tokens: 32\n"
        "algorithm:\n  dual_clip: null\nseed: 7\n"
    )
    flat = load_yaml(path)
    # PyYAML reads 1e-5 (no dot) as a string: parsed per annotation later.
    assert flat == {
        "train.lr": "1e-5",
        "train.betas": [0.9, 0.95],
        "rollout.max_tokens": 32,
        "algorithm.dual_clip": None,
        "seed": 7,
    }
    cfg = apply_overrides(RunConfig(), flat)
    assert (cfg.train.lr, cfg.train.betas, cfg.rollout.max_tokens, cfg.seed) == (
        1e-5,
        (0.9, 0.95),
        32,
        7,
    )
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_yaml(empty) == {}


def test_load_yaml_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: 1\n  x: [1, 2\n")
    with pytest.raises(ValueError, match=r"bad\.yaml:\d+: invalid YAML"):
        load_yaml(bad)
    listing = tmp_path / "list.yaml"
    listing.write_text("- train.lr=1\n")
    with pytest.raises(ValueError, match=r"list\.yaml: top level must be a mapping"):
        load_yaml(listing)
    twice = tmp_path / "twice.yaml"
    twice.write_text("train:\n  lr: 1.0\ntrain.lr: 2.0\n")
    with pytest.raises(ValueError, match=r"twice\.yaml: key 'train.lr' is set twice"):
        load_yaml(twice)


def test_build_config_precedence_recipe_yaml_cli(tmp_path):
    base = get_recipe("tiny_grpo_debug")
    path = tmp_path / "o.yaml"
    path.write_text("train:\n  lr: 0.001\n  num_steps: 9\n")
    cfg = build_config("tiny_grpo_debug", str(path), ["train.lr=0.002"])
    assert cfg.train.lr == 0.002  # cli beats yaml
    assert cfg.train.num_steps == 9  # yaml beats recipe
    assert cfg.rollout == base.rollout  # recipe kept where nothing overrides
    assert build_config("tiny_grpo_debug") == base


def test_round_trip_dict_json_yaml():
    cfg = apply_overrides(get_recipe("qwen05b_grpo"), ["train.betas=0.8,0.9", "model.path=m"])
    d = to_dict(cfg)
    assert d["train"]["betas"] == [0.8, 0.9]
    assert from_dict(d) == cfg
    assert from_dict(json.loads(json.dumps(d))) == cfg
    assert from_dict(yaml.safe_load(yaml.safe_dump(d))) == cfg
    with pytest.raises(ValueError, match="did you mean 'train.lr'"):
        from_dict({"train": {"lrr": 1.0}})


def test_pickles_for_spawned_ranks():
    cfg = get_recipe("tiny_grpo_debug")
    assert pickle.loads(pickle.dumps(cfg)) == cfg


# --- recipes -----------------------------------------------------------------


def test_recipes_build_and_match_their_descriptions():
    assert {"tiny_grpo_debug", "tiny_grpo_demo", "qwen05b_grpo"} <= set(RECIPES)
    debug = get_recipe("tiny_grpo_debug")
    assert debug.rollout.num_samples_per_prompt == 4 and debug.rollout.max_tokens == 16
    assert debug.rollout.tensor_parallel_size == 2 and debug.train.num_steps <= 5
    assert get_recipe("qwen05b_grpo").model.path == ""
    agent = get_recipe("gsm8k_python_tool_grpo")  # the GPU agent recipe: gsm8k_grpo + the tool
    assert (agent.env.name, agent.env.tools, agent.env.tool_parser) == ("tools", "python", "hermes")
    assert agent.env.dataset_path == get_recipe("gsm8k_grpo").env.dataset_path
    assert agent.env.tool_timeout_s >= agent.env.sandbox_timeout_s + 2  # the config's own bound
    for name in RECIPES:
        cfg = get_recipe(name)
        assert isinstance(cfg, RunConfig)
        assert from_dict(to_dict(cfg)) == cfg
    assert AlgorithmConfig().advantage == "grpo"


def test_unknown_recipe_lists_names_and_suggests():
    with pytest.raises(ValueError) as exc:
        get_recipe("tiny_grpo_debg")
    msg = str(exc.value)
    assert "did you mean 'tiny_grpo_debug'" in msg and "qwen05b_grpo" in msg
