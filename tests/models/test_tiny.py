"""Tests of hybrid_engine.models.tiny: deterministic folders that load in HF and vLLM."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybrid_engine.models.tiny import (
    PRESETS,
    TinyModelSpec,
    build_tokenizer,
    hf_config,
    hf_param_shapes,
    random_state_dict,
    write_tiny_model,
)
from hybrid_engine.models.tokenizer import (
    EOS_TOKEN_ID,
    TOKENIZER_VOCAB_SIZE,
    tokenizer_vocab_size,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = (
    "12+345=357\n",
    "Hello, world!  It's 3:45 pm.\n\n\tindented  trailing ",
    "a=[1, 2.5, -3e4]; print(a)  # done",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "caf\u00e9 na\u00efve \u4e2d\u6587 \U0001f600",
    "",
)

# (id, spec) of the HF load tests; the default vocab_size 1000 is not a
# multiple of 64.
HF_CASES = [
    ("qwen2", TinyModelSpec(arch="qwen2")),
    ("llama", TinyModelSpec(arch="llama")),
    ("qwen3", TinyModelSpec(arch="qwen3")),
    ("mistral", TinyModelSpec(arch="mistral", sliding_window=8)),
    ("phi3", TinyModelSpec(arch="phi3")),
    ("granite", TinyModelSpec(arch="granite")),
    ("gemma", TinyModelSpec(arch="gemma", sliding_window=8)),
    ("gemma2", TinyModelSpec(arch="gemma2", sliding_window=8, attn_softcap=5.0,
                             tie_word_embeddings=True)),
    ("qwen3_moe", TinyModelSpec(arch="qwen3_moe")),  # per-expert checkpoint keys
    ("mixtral-e5", TinyModelSpec(arch="mixtral", num_experts=5, experts_per_token=1)),
    ("qwen2-tied", TinyModelSpec(arch="qwen2", tie_word_embeddings=True)),
    ("llama-tied-kv1", TinyModelSpec(arch="llama", tie_word_embeddings=True, num_kv_heads=1)),
    ("qwen3-kv1-hd64", TinyModelSpec(arch="qwen3", num_kv_heads=1, head_dim=64)),
    ("qwen2-bf16-v1001", TinyModelSpec(arch="qwen2", dtype="bfloat16", vocab_size=1001)),
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {name: write_tiny_model(root / name, spec) for name, spec in HF_CASES}


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    spec = TinyModelSpec(arch="qwen3", num_layers=1)
    a = (write_tiny_model(tmp_path / "a", spec) / "model.safetensors").read_bytes()
    b = (write_tiny_model(tmp_path / "b", spec) / "model.safetensors").read_bytes()
    assert a == b
    w0 = load_file(tmp_path / "a" / "model.safetensors")
    w1 = random_state_dict(dataclasses.replace(spec, seed=1))
    for name, t in w0.items():
        if name.endswith("norm.weight"):
            assert torch.equal(t, w1[name])
        else:
            assert not torch.equal(t, w1[name]), name
    # Per-tensor seeding: tying drops lm_head but keeps the embedding.
    tied = random_state_dict(dataclasses.replace(spec, tie_word_embeddings=True))
    assert "lm_head.weight" not in tied
    assert torch.equal(tied["model.embed_tokens.weight"], w0["model.embed_tokens.weight"])


@pytest.mark.parametrize("name", [n for n, _ in HF_CASES])
def test_loads_in_transformers(name: str, folders: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    spec = dict(HF_CASES)[name]
    model, info = AutoModelForCausalLM.from_pretrained(folders[name], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.dtype == {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec.dtype]
    assert sum(p.numel() for p in model.parameters()) == spec.num_params
    sd = model.state_dict()
    expected = random_state_dict(spec)
    assert set(expected) <= set(sd) and set(sd) - set(expected) <= {"lm_head.weight"}
    for key, t in expected.items():
        assert torch.equal(sd[key], t), key
    if spec.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids_BT = torch.tensor([[1, 2, 3, EOS_TOKEN_ID], [4, 5, 6, spec.vocab_size - 1]])
    with torch.no_grad():
        logits_BTV = model(ids_BT).logits
    assert logits_BTV.shape == (2, 4, spec.vocab_size) and torch.isfinite(logits_BTV).all()


def test_param_shapes_and_presets() -> None:
    assert PRESETS["tiny"] == TinyModelSpec()
    assert 10e6 <= PRESETS["small"].num_params <= 20e6
    assert 170e6 <= PRESETS["qwen2-180m"].num_params <= 190e6
    shapes = hf_param_shapes(TinyModelSpec(arch="qwen3", head_dim=64))
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (4 * 64, 128)
    assert shapes["model.layers.1.self_attn.k_norm.weight"] == (64,)
    with pytest.raises(ValueError):
        TinyModelSpec(arch="qwen2", head_dim=64)
    with pytest.raises(ValueError):
        TinyModelSpec(vocab_size=TOKENIZER_VOCAB_SIZE - 1)
    with pytest.raises(ValueError):
        TinyModelSpec(num_heads=4, num_kv_heads=3)
    gemma2 = TinyModelSpec(arch="gemma2", attn_softcap=5.0, final_softcap=3.0,
                           tie_word_embeddings=True)
    config = hf_config(gemma2)
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (5.0, 3.0)
    assert "model.layers.0.self_attn.q_norm.weight" not in hf_param_shapes(gemma2)
    with pytest.raises(ValueError, match="gemma2 ties its embeddings"):
        TinyModelSpec(arch="gemma2")
    qwen3_moe = hf_config(TinyModelSpec(arch="qwen3_moe", num_experts=5, experts_per_token=3))
    mixtral = hf_config(TinyModelSpec(arch="mixtral", num_experts=5, experts_per_token=1))
    assert (qwen3_moe.num_experts, qwen3_moe.num_experts_per_tok) == (5, 3)
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok) == (5, 1)
    with pytest.raises(ValueError, match="experts_per_token <= num_experts"):
        TinyModelSpec(arch="mixtral", num_experts=2, experts_per_token=3)


@pytest.mark.parametrize("name", ["qwen2", "llama", "qwen3", "mistral"])
def test_auto_tokenizer_matches_raw_tokenizer(name: str, folders: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    folder = folders[name]
    tok = AutoTokenizer.from_pretrained(folder)
    raw = build_tokenizer()
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert ids == raw.encode(text).ids, text
        assert tok.decode(ids) == text
        assert raw.decode(ids, skip_special_tokens=False) == text
    assert tok("12+345=357\n")["input_ids"] == [ord(c) for c in "12+345=357\n"]
    # Whatever class AutoTokenizer picked, its backend is the file's pipeline.
    got = json.loads(tok.backend_tokenizer.to_str())
    want = json.loads(raw.to_str())
    for key in ("normalizer", "pre_tokenizer", "model", "decoder", "added_tokens"):
        assert got[key] == want[key], key
    assert tok.eos_token_id == tok.pad_token_id == EOS_TOKEN_ID and tok.bos_token_id is None
    assert len(tok) == TOKENIZER_VOCAB_SIZE
    config = json.loads((folder / "config.json").read_text())
    generation = json.loads((folder / "generation_config.json").read_text())
    assert config["eos_token_id"] == generation["eos_token_id"] == EOS_TOKEN_ID
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_words_are_one_token_each_and_any_text_still_round_trips(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from hybrid_engine.envs.chat import PromptFormat

    words = (" Tom", "Tom", " apples", "assistant")  # a word's tail first (the docs' rule)
    assert tokenizer_vocab_size(words) == TOKENIZER_VOCAB_SIZE + 3 + 2 + 6 + 8
    spec = TinyModelSpec(vocab_size=tokenizer_vocab_size(words), words=words)
    tok = AutoTokenizer.from_pretrained(write_tiny_model(tmp_path / "w", spec))
    raw = build_tokenizer(words)
    text = "Tom has 3 apples. Ask Tom."
    ids = tok(text)["input_ids"]
    assert ids == raw.encode(text).ids
    assert [tok.decode([i]) for i in ids] == [  # "as": a prefix of "assistant"
        "Tom", " ", "h", "as", " ", "3", " apples", ".", " ", "A", "s", "k", " Tom", "."]
    chat = PromptFormat("auto").ids(tok, "hi")
    assert "assistant" in [tok.decode([i]) for i in chat]
    for t in TEXTS:
        assert tok.decode(tok(t)["input_ids"]) == t
    assert len(tok) == tokenizer_vocab_size(words)
    with pytest.raises(ValueError, match="tokenizer size"):
        TinyModelSpec(vocab_size=tokenizer_vocab_size(words) - 1, words=words)


def test_mistrals_window_limits_attention_in_transformers(tmp_path: Path) -> None:
    """sliding_window=8 changes HF's logits from position 8 on, and only there: so
    vLLM matching HF below (test_vllm_matches_transformers) means vLLM windows too."""
    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM

    spec = TinyModelSpec(arch="mistral", sliding_window=8)
    ids = torch.arange(3, 23).unsqueeze(0)  # 20 tokens
    logits = {}
    for name, s in (("window", spec), ("full", dataclasses.replace(spec, sliding_window=None))):
        model = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / name, s))
        with torch.no_grad():
            logits[name] = model(ids).logits[0]
    diff = (logits["window"] - logits["full"]).abs().amax(-1)
    assert diff[:8].max() == 0 and diff[8:].min() > 1e-4, diff


# vLLM cases: one engine each, all in one fresh process. Every other family is
# checked against HF on the trained and gathered weights after a sync, with the
# same bound (tests/roles/test_sync.py), and the exported Qwen2, Llama and Mixtral
# folders in vLLM (tests/test_checkpoint.py, Mixtral's router too).
VLLM_CASES = [
    ("qwen3-tied-kv1-hd64", TinyModelSpec(arch="qwen3", tie_word_embeddings=True, num_kv_heads=1, head_dim=64)),
    # MoE from a per-expert checkpoint; the experts' weights are wide enough (init
    # 0.05) for routing to matter, and vLLM must route every token as HF does.
    ("qwen3_moe-e6-k2", TinyModelSpec(arch="qwen3_moe", init_std=0.05, intermediate_size=64)),
]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_matches_transformers(tmp_path: Path) -> None:
    from tests.models._vllm_check import check_in_fresh_process

    paths = [str(write_tiny_model(tmp_path / name, spec)) for name, spec in VLLM_CASES]
    results = check_in_fresh_process(paths)
    for path in paths:
        r = results[path]
        assert r["prompt_ids_equal"], path
        assert r["num_tokens"] == 4 * 16, path
        # fp32 vs fp32: measured ~5e-7; a wrong weight (or window) gives ~1e-1.
        assert r["max_abs_diff"] < 1e-5, (path, r["max_abs_diff"])
        if "moe" in path or "mixtral" in path:  # every token of every layer routed alike
            assert r["experts_routed"] > 4 * 16 * 2 and r["experts_mismatch"] == 0, (path, r)
