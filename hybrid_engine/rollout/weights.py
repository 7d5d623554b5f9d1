"""The engine's weight side: where a weight sync writes and how it is installed.

Job: `WeightStaging`, the half of `VLLMRollout` that weights go through.
vLLM's CPU build packs linear weights into oneDNN / sgl handles after loading:
those parameters become empty tensors and writes into them are lost; it
packs a FusedMoE layer's experts at the same size (`backend.packs`), and its
own reload does not re-pack them. A sync therefore writes such weights into
staging tensors (`weight_targets`), and `install_staged` / `commit_weights`
install them (the backend re-packs; an MoE layer's w13 and w2 together).
Every other parameter (and all of them on GPU) is plain and written in
place. With `double_buffer` (separate placement, generation ahead) every
target is a persistent back buffer, installed only by `commit_weights`, so a
generation running meanwhile never reads half-written weights. The naive
paths load full HF tensors through vLLM's own loading
(`load_full_weights`; MoE experts through vLLM's loader and the backend's
install); verify mode asks vLLM's loaders what they make of them
(`reference_weights`).

Invariant: after a release that discarded the weights, `weights_valid` stays
False until the sync calls `mark_weights_written`, and the engine refuses to
sample meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from hybrid_engine.models.experts import checkpoint_tensors
from hybrid_engine.models.spec import spec_for
from hybrid_engine.rollout import vllm_compat

if TYPE_CHECKING:
    from vllm import LLM

__all__ = ["WeightStaging"]


_FUSED = {
    "qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
    "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
}


def _hf_sources(vllm_name: str, hf_names: Mapping[str, Any],
                moe_block: str) -> list[tuple[str, str | int | None]]:
    """HF tensors (and vLLM shard ids) that a vLLM parameter is loaded from: HF's
    own fused tensor when it has one (vLLM's loader splits it), else the
    separate ones; a router under vLLM's MoE block name (`ModelDims.moe_block`)
    from HF's `mlp`."""
    router = _hf_block(vllm_name, moe_block)
    if vllm_name not in hf_names and router in hf_names:
        return [(router, None)]
    parts = vllm_name.rsplit(".", 2)
    if len(parts) == 3 and parts[1] in _FUSED and vllm_name not in hf_names:
        prefix, module, suffix = parts
        return [(f"{prefix}.{hf}.{suffix}", sid) for hf, sid in _FUSED[module]]
    return [(vllm_name, None)]


def _hf_block(vllm_name: str, moe_block: str) -> str:
    """vllm_name with vLLM's MoE block name as HF's (`mlp`)."""
    return vllm_name.replace(f".{moe_block}.", ".mlp.")


_FUSED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")


def _expert_module(hf_name: str, modules: Mapping[str, Any], moe_block: str) -> str:
    """The vLLM FusedMoE module that HF's fused experts tensor loads into."""
    block = hf_name.rsplit(".experts.", 1)[0].replace(".mlp", f".{moe_block}")
    if f"{block}.experts.routed_experts" not in modules:
        raise KeyError(f"vLLM model has no experts module for {hf_name}")
    return f"{block}.experts.routed_experts"


def _expert_source(vllm_name: str, full: Mapping[str, Any], moe_block: str) -> str:
    """HF's fused experts tensor a FusedMoE parameter is loaded from."""
    block = _hf_block(vllm_name, moe_block).split(".experts.", 1)[0]
    hf = f"{block}.experts.{'gate_up_proj' if vllm_name.endswith('w13_weight') else 'down_proj'}"
    if hf not in full:
        raise KeyError(f"no HF tensor {hf} for {vllm_name}")
    return hf


class WeightStaging:
    """VLLMRollout's weight side (see the module docstring); the engine (`llm`) and
    its platform `backend` are the engine's.

    Attributes:
        weights_valid: False from a release that discards the weights (GPU sleep
            level 2, or its CPU emulation) until a sync has rewritten them all.
        double_buffer: write every weight into back buffers, installed by
            commit_weights() only.
        staging_bytes: size of the staging arena (largest group staged), or of
            the back buffers.
    """

    llm: LLM
    backend: Any

    def _init_weights(self, double_buffer: bool = False) -> None:
        self.weights_valid = True
        self.double_buffer = double_buffer
        self.staging_bytes = 0
        self._staging: dict[str, torch.Tensor] = {}
        self._arena: torch.Tensor | None = None
        self._back: dict[str, torch.Tensor] = {}
        self._repack_s = 0.0

    def _model(self) -> torch.nn.Module:
        return vllm_compat.model(self.llm)

    def _moe_block(self) -> str:
        """vLLM's name of the served model's MoE block (its family's spec's)."""
        return spec_for(vllm_compat.hf_config(self.llm)).moe_block

    def weight_targets(self, shapes: Mapping[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
        """The tensors a sync writes this rank's TP-local weights into.

        Args:
            shapes: vLLM parameter name -> TP-local 2-D shape (the plan's
                targets; 1-D parameters as [n, 1]).

        Returns:
            name -> contiguous tensor of that shape in the model dtype: the
            vLLM parameter itself when it is a plain tensor of that dtype, else
            a staging view into a reused arena, installed by install_staged()
            (so every weight is rounded to the model dtype exactly once, as in
            vLLM's own loading). Call install_staged() before asking for the
            next names: the arena is reused. With double_buffer every target
            is a persistent back buffer instead, and only commit_weights()
            installs them (a generation meanwhile sees the old weights).
        """
        params = dict(self._model().named_parameters())
        dtype = vllm_compat.model_dtype(self.llm)
        if self.double_buffer:
            return self._back_targets(shapes, params, dtype)
        assert not self._staging, "install_staged() the previous targets first"
        out, staged = {}, []
        for name, (rows, cols) in shapes.items():
            p = params.get(name)
            if p is None:
                raise KeyError(f"vLLM model has no parameter {name!r}")
            if p.numel() == rows * cols and p.dtype == dtype and not self.backend.packs(name):
                out[name] = p.data.view(rows, cols)
            else:  # packed by vLLM-CPU (GEMMs, MoE experts), or kept in another dtype
                staged.append((name, rows, cols, p.device))
        itemsize = torch.empty((), dtype=dtype).element_size()
        need = sum(r * c for _, r, c, _ in staged) * itemsize
        if staged and (self._arena is None or self._arena.numel() < need):
            self._arena = torch.empty(need, dtype=torch.uint8, device=staged[0][3])
        offset = 0
        for name, rows, cols, _ in staged:
            n = rows * cols * itemsize
            self._staging[name] = self._arena[offset : offset + n].view(dtype).view(rows, cols)
            out[name] = self._staging[name]
            offset += n
        self.staging_bytes = max(self.staging_bytes, need)
        return out

    def _back_targets(self, shapes: Mapping[str, tuple[int, int]], params: dict,
                      dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """double_buffer: every target is a persistent back buffer (allocated on
        first use, reused by every later sync), installed by commit_weights()."""
        out = {}
        for name, (rows, cols) in shapes.items():
            p = params.get(name)
            if p is None:
                raise KeyError(f"vLLM model has no parameter {name!r}")
            buf = self._back.get(name)
            if buf is None or tuple(buf.shape) != (rows, cols):
                buf = self._back[name] = torch.empty(rows, cols, dtype=dtype, device=p.device)
            self._staging[name] = out[name] = buf
        self.staging_bytes = sum(b.numel() * b.element_size() for b in self._back.values())
        return out

    def install_staged(self, *, final: bool = False) -> float:
        """Installs the staged weights (CPU: the backend re-packs them); frees the
        arena for reuse. Returns the seconds spent. With double_buffer only the
        final call (commit_weights) installs: the back buffers hold the whole
        model until then."""
        if not self._staging or (self.double_buffer and not final):
            return 0.0
        t0 = time.perf_counter()
        modules = dict(self._model().named_modules())
        params = dict(self._model().named_parameters())
        experts: dict[str, dict[str, torch.Tensor]] = {}
        for name, staged in self._staging.items():
            module, leaf = name.rsplit(".", 1)
            p = params[name]
            if self.backend.packs(name):  # a FusedMoE layer's w13 and w2 go in together
                experts.setdefault(module, {})[leaf] = staged
            elif p.numel() == staged.numel():  # e.g. a bias vLLM-CPU keeps in fp32
                p.data.copy_(staged.view(p.shape))
            else:
                self.backend.install(modules[module], staged)
        for module, staged in experts.items():
            self.backend.install_experts(modules[module], staged)
        self._staging = {}
        dt = time.perf_counter() - t0
        self._repack_s += dt
        return dt

    def commit_weights(self, *, running: bool = False) -> float:
        """Finishes a sync: installs anything still staged, refreshes the packed
        copies the backend keeps (CPU: vocab-parallel lm_head, and embed_tokens
        when tied), resets the prefix cache. Returns the seconds spent
        re-packing during this sync.

        running: the install lands between two engine steps of a generation
            (async_rollout.inflight_updates): the running requests are preempted too
            (vLLM's reset_prefix_cache(reset_running_requests=True)), so their
            KV, computed with the old weights, is recomputed with the new ones
            (prompt and tokens so far) when they are scheduled again."""
        self.install_staged(final=True)
        self._repack_s += self.backend.refresh_packed(self._model())
        # cached KV was computed with the old weights
        if not self.llm.reset_prefix_cache(reset_running_requests=running):
            raise RuntimeError("vLLM did not reset its prefix cache after a weight install: "
                               "requests still hold KV blocks computed with the old weights, "
                               "which the next tokens would attend to")
        repack_s, self._repack_s = self._repack_s, 0.0
        return repack_s

    def mark_weights_written(self) -> None:
        """Called by the weight sync once every weight has been rewritten: the
        engine may sample again after a release that discarded them."""
        self.weights_valid = True

    def load_full_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *,
                          partial: bool = False) -> None:
        """The naive paths: full HF tensors through vLLM's own loading (what
        TRL and verl do). Re-packs on CPU; resets the prefix cache.

        partial: the weights are one bucket of a sync (every vLLM module they
        touch complete, others absent): vLLM keeps the absent modules as they
        are, and its per-module "not loaded" warnings are silenced.
        """
        quiet = [logging.getLogger(n) for n in vllm_compat.RELOAD_LOGGERS] if partial else []
        levels = [lg.level for lg in quiet]
        experts: dict[str, torch.Tensor] = {}
        weights = self._for_reload(weights, experts)
        for lg in quiet:
            lg.setLevel(logging.ERROR)
        try:
            vllm_compat.reload_weights(self.llm, weights)
        finally:
            for lg, level in zip(quiet, levels):
                lg.setLevel(level)
        if experts:
            self._load_full_experts(experts)
        self.llm.reset_prefix_cache()

    def _for_reload(self, weights: Iterable[tuple[str, torch.Tensor]],
                    experts: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights as vLLM's reload takes them: in the checkpoint's form (MoE
        experts one tensor each, routers renamed as the family's checkpoints
        name them: `models.experts`).
        HF's fused experts go to `experts` instead where the backend re-packs
        them (`packs`), which vLLM's reload does not do on a second load."""
        model_type = vllm_compat.hf_model_type(self.llm)
        for name, t in weights:
            if name.endswith(_FUSED_EXPERTS) and self.backend.packs(name + ".w13_weight"):
                experts[name] = t
            else:
                yield from checkpoint_tensors(model_type, {name: t}).items()

    def _load_full_experts(self, full: Mapping[str, torch.Tensor]) -> None:
        """The naive paths' experts: vLLM's loader into raw tensors, then installed
        as a sync installs them (`backend.install_experts`)."""
        modules = dict(self._model().named_modules())
        device = next(self._model().parameters()).device
        moe_block = self._moe_block()
        for module in dict.fromkeys(_expert_module(n, modules, moe_block) for n in full):
            layer = modules[module]
            staged = {leaf: self._reference_experts(layer, f"{module}.{leaf}", full, *shape, device)
                      for leaf, shape in zip(vllm_compat.EXPERT_WEIGHTS,
                                             vllm_compat.expert_shapes(layer), strict=True)}
            self.backend.install_experts(layer, staged)

    def reference_weights(
        self, full: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, int]],
    ) -> dict[str, torch.Tensor]:
        """What vLLM's own weight loaders make of full HF tensors on this rank.

        The oracle of the verify mode: each layer's `weight_loader` fills a
        fresh tensor of the TP-local shape in the model dtype, as at load time
        (vLLM's packed parameters cannot be read back on CPU). Compare with
        what weight_targets received, which is in the model dtype too.
        Returns vLLM name -> 2-D tensor.
        """
        modules = dict(self._model().named_modules())
        moe_block = self._moe_block()
        device = next(self._model().parameters()).device  # beside the targets (CUDA)
        out: dict[str, torch.Tensor] = {}
        for name, (rows, cols) in shapes.items():
            layer = modules[name.rsplit(".", 1)[0]]
            if name.rsplit(".", 1)[-1] in vllm_compat.EXPERT_WEIGHTS:
                out[name] = self._reference_experts(layer, name, full, rows, cols, device)
                continue
            shape = (rows,) if cols == 1 else (rows, cols)
            shadow = torch.nn.Parameter(torch.zeros(shape, dtype=vllm_compat.model_dtype(self.llm),
                                                    device=device), requires_grad=False)
            sharded = cols > 1 or name.endswith(".bias")  # norms are replicated
            if sharded:
                vllm_compat.set_weight_attrs(shadow, {"output_dim": 0, **({"input_dim": 1} if cols > 1 else {})})
            for hf_name, shard_id in _hf_sources(name, full, moe_block):
                t = full[hf_name].to(device)
                if not sharded:
                    shadow.data.copy_(t.view(shape))
                elif shard_id is None:
                    layer.weight_loader(shadow, t)
                else:
                    layer.weight_loader(shadow, t, shard_id)
            out[name] = shadow.data.view(rows, cols)
        return out

    def _reference_experts(self, layer: torch.nn.Module, name: str,
                           full: Mapping[str, torch.Tensor], rows: int, cols: int,
                           device: torch.device) -> torch.Tensor:
        """reference_weights for a FusedMoE layer's w13 or w2: its loader, expert by
        expert, from HF's fused tensor (3-D, or its 2-D view)."""
        experts = layer.w13_weight.shape[0]
        shadow = torch.nn.Parameter(torch.zeros(experts, rows // experts, cols,
                                                dtype=vllm_compat.model_dtype(self.llm),
                                                device=device), requires_grad=False)
        hf = _expert_source(name, full, self._moe_block())
        t = full[hf].to(device)
        vllm_compat.load_expert_weight(layer, shadow, t.view(experts, -1, t.shape[-1]), name)
        return shadow.data.view(rows, cols)
