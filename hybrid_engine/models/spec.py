"""A model family's spec: what the engine reads from a HF config, and what it refuses.

Job: one `ModelSpec` per family, in `models/families/<family>.py`, registered
by its HF architecture name (`MODEL_SPECS`); `spec_for(config)` finds a
config's, and `model_dims(config)` reads the `ModelDims` every layout, plan
and check works from. A family states its features (q/k/v biases, q/k norms,
HF's fused tensors, Gemma's feed-forward norms, experts and the name of vLLM's
MoE block) and its refusals, each a one-line `ValueError`; vLLM's TP layout
(`reshard.layouts`) and the training TP plan (`ModelSpec.tp_plan`) follow from
the features alone, unless a family overrides them.

Invariant: no module outside `models/` names an architecture; a family is
one file here (discovered at the first lookup) plus its test line.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, ClassVar

from hybrid_engine.names import Registry

__all__ = ["MODEL_SPECS", "ModelDims", "ModelSpec", "hf_param_shapes", "model_dims", "register",
           "spec_for", "supported", "tiny_archs", "tiny_spec"]

MODEL_SPECS: Registry[ModelSpec] = Registry("model architecture")
# Mixtures of Experts with shared experts: no layout for them.
SHARED_EXPERT_ARCHITECTURES = ("Qwen2MoeForCausalLM", "DeepseekV2ForCausalLM",
                               "DeepseekV3ForCausalLM", "Llama4ForCausalLM",
                               "Qwen3NextForCausalLM", "Glm4MoeForCausalLM")


@dataclass(frozen=True, slots=True)
class ModelDims:
    """The shape facts of a HF config that the layout depends on."""

    arch: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    o_bias: bool = False
    fused: bool = False
    """HF stores qkv_proj and gate_up_proj fused (Phi-3)."""
    ffn_norms: bool = False
    """pre_feedforward_layernorm and post_feedforward_layernorm (Gemma 3)."""
    num_experts: int = 0
    """Routed experts of every MoE layer (0: a dense model); `intermediate` is
    then each expert's width."""
    moe_block: str = "mlp"
    """vLLM's name of a layer's MoE block (HF's is `mlp`)."""

    @property
    def moe(self) -> bool:
        return self.num_experts > 0


class ModelSpec:
    """A family: its HF architecture, features and refusals, and how the tests'
    tiny models of it are configured (`models.tiny`). Subclasses set the class
    attributes and override the methods where the family differs."""

    architecture: ClassVar[str]
    name: ClassVar[str]
    """For messages ("Qwen3-MoE")."""
    qk_norm: ClassVar[bool] = False
    fused: ClassVar[bool] = False
    ffn_norms: ClassVar[bool] = False
    moe: ClassVar[bool] = False
    moe_block: ClassVar[str] = "mlp"
    tiny_arch: ClassVar[str]
    """Its name as `TinyModelSpec.arch` and `hybrid-engine tiny --arch`."""
    config_class: ClassVar[str]
    """Its transformers config class."""
    model_type: ClassVar[str | None] = None
    """MoE: transformers' model_type, whose checkpoints store experts one by one."""
    norm_centre: ClassVar[float] = 1.0
    """The norm weights' neutral value (0 where norms scale by 1 + weight)."""
    windowed: ClassVar[bool] = False
    """A tiny model may set sliding_window."""
    attention_bias: ClassVar[bool] = False
    """A tiny model may set attention_bias."""

    def check(self, config: Any) -> None:
        """Raises ValueError (one line) for what of config the engine cannot follow."""

    def head_dim(self, config: Any) -> int:
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def biases(self, config: Any) -> tuple[bool, bool]:
        """(q/k/v biases, o_proj bias)."""
        return bool(getattr(config, "attention_bias", False)), False

    def experts(self, config: Any) -> tuple[int, int]:
        """(routed experts, each one's width); (0, MLP width) for a dense model."""
        return 0, config.intermediate_size

    def tp_plan(self, d: ModelDims) -> dict[str, str]:
        """The training TP plan (train.tensor_parallel_size): a decoder layer's module
        path -> "colwise" (output features split over the TP ranks), "rowwise"
        (input features split, outputs summed) or "head_norm" (a per-head norm
        whose weight each TP rank applies to its own heads: its gradient is
        summed over them). Attention always; the MLP of a dense model; an MoE
        block, the norms, the embedding and the head are not split.

        Raises:
            ValueError: the family has no TP plan for training (one line).
        """
        plan = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise",
                "self_attn.v_proj": "colwise", "self_attn.o_proj": "rowwise"}
        if d.qk_norm:
            plan |= {"self_attn.q_norm": "head_norm", "self_attn.k_norm": "head_norm"}
        if not d.moe:
            plan |= {"mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                     "mlp.down_proj": "rowwise"}
        return plan

    def tiny_check(self, t: Any) -> None:
        """Raises ValueError for what a `TinyModelSpec` t may not set for the family."""

    def tiny_config(self, t: Any, rope: dict) -> dict:
        """The family's transformers config kwargs for tiny spec t (rope: its RoPE)."""
        return {"hidden_act": "silu", "rope_parameters": rope}

    def dims(self, config: Any) -> ModelDims:
        """config's ModelDims, its refusals checked."""
        if getattr(config, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        self.check(config)
        heads = config.num_attention_heads
        qkv_bias, o_bias = self.biases(config)
        experts, intermediate = self.experts(config)
        return ModelDims(
            arch=self.architecture, num_layers=config.num_hidden_layers,
            hidden=config.hidden_size, num_heads=heads,
            num_kv_heads=config.num_key_value_heads or heads, head_dim=self.head_dim(config),
            intermediate=intermediate, vocab=config.vocab_size,
            tied=bool(config.tie_word_embeddings), qkv_bias=qkv_bias, qk_norm=self.qk_norm,
            o_bias=o_bias, fused=self.fused, ffn_norms=self.ffn_norms, num_experts=experts,
            moe_block=self.moe_block)


def hf_param_shapes(d: ModelDims) -> dict[str, tuple[int, ...]]:
    """Every HF parameter's name and shape, in file order (experts: transformers'
    fused 3-D tensors; no lm_head when tied)."""
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (d.vocab, d.hidden)}
    q, kv, h = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim, d.hidden
    for i in range(d.num_layers):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out[p + "input_layernorm.weight"] = (h,)
        if d.fused:
            out[a + "qkv_proj.weight"] = (q + 2 * kv, h)
        else:
            out.update({a + "q_proj.weight": (q, h), a + "k_proj.weight": (kv, h),
                        a + "v_proj.weight": (kv, h)})
        if d.qkv_bias:
            out.update({a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)})
        if d.qk_norm:
            out.update({a + "q_norm.weight": (d.head_dim,), a + "k_norm.weight": (d.head_dim,)})
        out[a + "o_proj.weight"] = (h, q)
        if d.o_bias:
            out[a + "o_proj.bias"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        if d.ffn_norms:
            out.update({p + "pre_feedforward_layernorm.weight": (h,),
                        p + "post_feedforward_layernorm.weight": (h,)})
        if d.moe:
            out.update({m + "gate.weight": (d.num_experts, h),
                        m + "experts.gate_up_proj": (d.num_experts, 2 * d.intermediate, h),
                        m + "experts.down_proj": (d.num_experts, h, d.intermediate)})
        elif d.fused:
            out.update({m + "gate_up_proj.weight": (2 * d.intermediate, h),
                        m + "down_proj.weight": (h, d.intermediate)})
        else:
            out.update({m + "gate_proj.weight": (d.intermediate, h),
                        m + "up_proj.weight": (d.intermediate, h),
                        m + "down_proj.weight": (h, d.intermediate)})
    out["model.norm.weight"] = (h,)
    if not d.tied:
        out["lm_head.weight"] = (d.vocab, h)
    return out


def register(spec: ModelSpec) -> ModelSpec:
    """Adds a family's spec to MODEL_SPECS (a family module's last line)."""
    MODEL_SPECS.add(spec.architecture, spec)
    return spec


@functools.cache
def _discover() -> None:
    """Imports every module of models/families, once (each registers its spec)."""
    from hybrid_engine.models import families

    for m in pkgutil.iter_modules(families.__path__):
        importlib.import_module(f"{families.__name__}.{m.name}")


def tiny_spec(arch: str) -> ModelSpec:
    """The family whose tiny models are `TinyModelSpec(arch=arch)`.

    Raises:
        ValueError: no family has that tiny name (listing those there are).
    """
    by_tiny = {MODEL_SPECS.get(a).tiny_arch: MODEL_SPECS.get(a) for a in supported()}
    if arch not in by_tiny:
        raise ValueError(f"arch must be one of {tiny_archs()}, got {arch!r}")
    return by_tiny[arch]


def tiny_archs() -> tuple[str, ...]:
    """Every family's tiny name (`TinyModelSpec.arch`), in architecture order."""
    return tuple(MODEL_SPECS.get(a).tiny_arch for a in supported())


def supported(moe: bool | None = None) -> list[str]:
    """The supported architectures, sorted (moe: only MoE ones, or only dense)."""
    _discover()
    return [a for a in MODEL_SPECS.names() if moe is None or MODEL_SPECS.get(a).moe == moe]


def spec_for(config: Any) -> ModelSpec:
    """The spec of a HF config's architecture.

    Raises:
        ValueError: the config names none, or one not supported (listing those that are).
    """
    archs = list(getattr(config, "architectures", None) or [])
    arch = archs[0] if archs else ""
    if arch in SHARED_EXPERT_ARCHITECTURES or getattr(config, "shared_expert_intermediate_size", 0):
        raise ValueError(f"{arch or config.model_type}: a Mixture-of-Experts with shared experts "
                         "is not supported (the resharding planner has no layout for them); "
                         f"supported MoE: {', '.join(supported(moe=True))}")
    if not arch:
        raise ValueError(f"the config (model_type {getattr(config, 'model_type', None)!r}) names "
                         f"no architecture: add \"architectures\": [one of "
                         f"{', '.join(supported())}]")
    if arch not in supported():
        raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(supported())}")
    return MODEL_SPECS.get(arch)


def model_dims(config: Any) -> ModelDims:
    """Reads ModelDims from a transformers config (or anything with its fields).

    Raises:
        ValueError: the architecture is not supported (lists the supported ones),
            or the family refuses something of the config.
    """
    return spec_for(config).dims(config)
