"""Every access to vLLM's private API and every patch of it, in one file.

Job: the rest of the package talks to vLLM through its public API (`LLM`,
`SamplingParams`, `TokensPrompt`, `sleep`/`wake_up`, `reset_prefix_cache`)
and through the functions here. Each function says what it reaches into and
was written for, and checked on, `VLLM_VERSION`; a vLLM upgrade is a review
of this file (tests/test_boundaries.py keeps the private attributes here).

Invariant: importing this module never imports vLLM (callers set the
process environment first, `prepare_process_env`); patches are applied at
most once per process and the world restriction is undone by its caller.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable, Sequence

import torch

from hybrid_engine.rollout import cpu_shm

__all__ = [
    "VLLM_VERSION", "attention_head_sizes", "cache_config", "check_version", "cpu_packed_bytes",
    "dispatch_cpu_gemm", "eager_cpu_helpers",
    "engine_loop", "is_cpu",
    "isolate_cpu_shm_names", "kv_cache_tensors", "model", "model_dtype", "prepare_process_env",
    "reload_weights", "restrict_world", "set_weight_attrs", "shm_all_gather", "shm_allreduce",
    "lora_engine_kwargs", "shm_manager", "shutdown", "swap_lora", "zentorch_gemm",
]

VLLM_VERSION = "0.32.0"  # what every function below was written for and checked on
# Also reviewed function by function and run (CUDA build, level-2 sleep, training jobs):
# 0.26.0, the newest CUDA build the GPU machines' torch takes (docs/architecture.md).
ALSO_CHECKED = ("0.26.0",)

_log = logging.getLogger(__name__)
_checked = False


def check_version() -> None:
    """Warns once when the installed vLLM is not a version this file was checked on."""
    global _checked
    if _checked:
        return
    _checked = True
    import vllm

    if not vllm.__version__.startswith((VLLM_VERSION, *ALSO_CHECKED)):
        _log.warning("vLLM %s is installed; hybrid_engine.rollout.vllm_compat was checked on %s: "
                     "review it (private attributes, patches) before trusting the run",
                     vllm.__version__, ", ".join((VLLM_VERSION, *ALSO_CHECKED)))


def prepare_process_env() -> None:
    """Env vars vLLM reads at import/engine time; set before importing vllm.
    VLLM_ENABLE_V1_MULTIPROCESSING=0: the in-process engine external_launcher
    requires (and much faster on CPU). [0.32]"""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def is_cpu() -> bool:
    """Whether vLLM runs on its CPU platform (public: vllm.platforms)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def attention_head_sizes() -> list[int] | None:
    """The head sizes the installed vLLM's attention runs: on its CPU platform,
    those of its one attention backend (`CPUAttentionBackend.get_supported_head_sizes`,
    a public classmethod) [0.32]; None on other platforms (CUDA picks among
    several backends by head size itself)."""
    prepare_process_env()
    if not is_cpu():
        return None
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return list(CPUAttentionBackend.get_supported_head_sizes())


def isolate_cpu_shm_names() -> None:
    """Patch [0.32, private `cpu_communicator._CPUSHMDistributed.make_group_name`]:
    makes vLLM-CPU's shared-memory segment names unique per job.

    Under external_launcher vLLM derives the name from the init method
    "env://", the same for every job: two jobs on one machine (or a leftover
    segment from a killed job) collide with "create shm in SHMManager failed.
    errno: 17". The prefix is unique per job (`cpu_shm.prefix`); vLLM never
    unlinks the segments, so the CPU backend does at shutdown, and each new
    engine first removes those of dead jobs (`cpu_shm.sweep_orphans`).
    """
    try:
        from vllm.distributed.device_communicators import cpu_communicator as cc
    except ImportError:  # a vLLM build without the CPU communicator (CUDA)
        return
    shm = cc._CPUSHMDistributed
    if getattr(shm, "_hybrid_engine_patched", False):
        return
    removed = cpu_shm.sweep_orphans() + cpu_shm.sweep_foreign_orphans()
    if removed:
        _log.info("removed %d shared-memory segment(s) of dead jobs from /dev/shm", len(removed))
    original = shm.make_group_name

    def make_group_name(communicator) -> str:  # noqa: ANN001
        # shm_open names take no "/" past the first; vLLM's own has "//".
        return cpu_shm.prefix() + original(communicator).replace("/", "")

    shm.make_group_name = staticmethod(make_group_name)
    shm._hybrid_engine_patched = True


def eager_cpu_helpers() -> None:
    """Patch [0.32, private module globals `vocab_parallel_embedding.get_masked_input_and_mask`
    and `sampler.batched_count_greater_than`]: runs these two helpers eagerly on CPU.

    vLLM wraps both in `torch.compile(backend="inductor")`. On CPU their first
    calls cost ~1.8 s per process (importing inductor, probing the CPU's vector
    ISA, loading the cached kernels), ~2 s of a tiny 2-rank job's 12.5 s, for a
    few elementwise integer ops over the batch's token ids (the vocabulary mask
    of a tensor-parallel embedding) and a row-wise count (the sampled token's
    rank). Eager gives the same integers.
    """
    from vllm.model_executor.layers import vocab_parallel_embedding as vpe
    from vllm.v1.sample import sampler

    for module, name in ((vpe, "get_masked_input_and_mask"),
                         (sampler, "batched_count_greater_than")):
        fn = getattr(module, name)
        setattr(module, name, getattr(fn, "_torchdynamo_orig_callable", fn))


def restrict_world(ranks: list[int]) -> Callable[[], None]:
    """Patch [0.32, `parallel_state.init_world_group` / `initialize_model_parallel`
    / `init_model_parallel_group`]: makes the next engine's external_launcher see
    only `ranks` as its world. Returns the undo function.

    vLLM makes its world group range(torch world size) and lays its TP grid
    over it; its collectives would then wait for ranks that build no engine.
    Replaced here (restored by the returned function, after the engine is
    built): the world group is `ranks`, the grid is laid over len(ranks)
    ranks and each grid index maps to its global rank. Only the engine ranks
    create these groups, so torch's group counter must be re-synchronised on
    every rank afterwards (`hybrid_engine.parallel.dist.resync_group_counter`).
    (docs/placement.md.)
    """
    import torch.distributed as dist
    import vllm.distributed.parallel_state as ps

    world, imp, impg = ps.init_world_group, ps.initialize_model_parallel, ps.init_model_parallel_group

    def init_world_group(_ranks, local_rank, backend):  # noqa: ANN001, ANN202
        return world(list(ranks), local_rank, backend)

    def init_model_parallel_group(group_ranks, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        return impg([[ranks[i] for i in g] for g in group_ranks], *a, **k)

    def initialize_model_parallel(*a, **k):  # noqa: ANN002, ANN003, ANN202
        gws = dist.get_world_size
        dist.get_world_size = lambda group=None: len(ranks) if group is None else gws(group)
        ps.init_model_parallel_group = init_model_parallel_group
        try:
            return imp(*a, **k)
        finally:
            dist.get_world_size, ps.init_model_parallel_group = gws, impg

    ps.init_world_group, ps.initialize_model_parallel = init_world_group, initialize_model_parallel

    def undo() -> None:
        ps.init_world_group, ps.initialize_model_parallel = world, imp

    return undo


def tp_cpu_group():  # noqa: ANN201
    """This rank's vLLM tensor-parallel group for CPU collectives (gloo):
    `parallel_state.get_tp_group().cpu_group`. [0.32, public function]"""
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group().cpu_group


def _runner(llm):  # noqa: ANN001, ANN202
    """[0.32, private] the in-process engine's model runner:
    llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner."""
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    return executor.driver_worker.worker.model_runner


def model(llm) -> torch.nn.Module:  # noqa: ANN001
    """The vLLM model module of this rank (its TP-local parameters). [0.32, private]"""
    return _runner(llm).model


def engine_loop(llm):  # noqa: ANN001, ANN201
    """The LLMEngine behind `LLM.generate` (`llm.llm_engine`), whose loop partial
    rollouts drive themselves: add_request(request_id, prompt, params) (DELTA
    outputs: each step() returns only new tokens and log-probs), step(),
    has_unfinished_requests(), abort_request([request_id]) (frees the KV
    blocks; the request's output so far is whatever earlier steps returned).
    [0.32, public attribute and methods of the V1 LLMEngine]"""
    return llm.llm_engine


def logprob_params() -> dict:
    """SamplingParams keywords for log-prob requests: flat_logprobs=True where
    this vLLM has it (a few flat lists per request in place of a dict and a
    Logprob object per token, vllm#28171). [0.32]"""
    from vllm import SamplingParams

    return {"flat_logprobs": True} if "flat_logprobs" in SamplingParams.__struct_fields__ else {}


def token_logprobs(entries, token_ids: Sequence[int]) -> list[float]:  # noqa: ANN001
    """The log-prob of token_ids[i] at each position of vLLM's log-prob entries
    (a completion's `logprobs` or a slice of `prompt_logprobs`, flat or one dict
    per position); NaN everywhere when the request asked for none (entries None).
    [0.32: FlatLogprobs' token_ids / logprobs lists]"""
    if entries is None:
        return [math.nan] * len(token_ids)
    flat_ids = getattr(entries, "token_ids", None)
    if flat_ids is not None and len(flat_ids) == len(token_ids) and flat_ids == list(token_ids):
        return list(entries.logprobs)  # logprobs=0: the one entry per position is the token's
    return [lp[t].logprob for t, lp in zip(token_ids, entries, strict=True)]


def engine_facts(llm) -> dict:  # noqa: ANN001
    """The settings vLLM resolved for this engine, for the run's record: version,
    async scheduling, model runner, attention backend, CUDA-graph and compile
    modes, batch limits, KV blocks, the weights' dtype, the TP size. [0.26-0.32: vllm_config fields; the runner's
    attn_groups, private]"""
    import vllm

    vc = llm.llm_engine.vllm_config
    sc, cc = vc.scheduler_config, vc.compilation_config
    runner = _runner(llm)
    try:
        attention = sorted({g.backend.get_name() for groups in runner.attn_groups for g in groups})
    except AttributeError:
        attention = None
    return {
        "vllm": vllm.__version__, "dtype": str(vc.model_config.dtype).removeprefix("torch."),
        "tensor_parallel_size": vc.parallel_config.tensor_parallel_size,
        "async_scheduling": bool(sc.async_scheduling),
        "model_runner": type(runner).__name__, "attention_backend": attention,
        "cudagraph_mode": str(getattr(cc, "cudagraph_mode", None)),
        "compile_mode": str(getattr(cc, "mode", None)),
        "cudagraph_capture_sizes": len(cc.cudagraph_capture_sizes or []),
        "max_num_seqs": sc.max_num_seqs, "max_num_batched_tokens": sc.max_num_batched_tokens,
        "enforce_eager": vc.model_config.enforce_eager,
        "prefix_caching": vc.cache_config.enable_prefix_caching,
        "kv_blocks": vc.cache_config.num_gpu_blocks, "block_size": vc.cache_config.block_size,
    }


def model_dtype(llm) -> torch.dtype:  # noqa: ANN001
    """The engine's model dtype (llm_engine.model_config.dtype). [0.32]"""
    return llm.llm_engine.model_config.dtype


def cache_config(llm):  # noqa: ANN001, ANN201
    """The engine's cache config (block_size, num_gpu_blocks): llm_engine.vllm_config. [0.32]"""
    return llm.llm_engine.vllm_config.cache_config


def hf_model_type(llm) -> str:  # noqa: ANN001
    """The served model's HF model_type (its config's). [0.32]"""
    return llm.llm_engine.model_config.hf_config.model_type


def hf_config(llm):  # noqa: ANN001, ANN201 - a transformers config
    """The served model's HF config. [0.32]"""
    return llm.llm_engine.model_config.hf_config


def kv_cache_tensors(llm) -> list[torch.Tensor]:  # noqa: ANN001
    """The KV cache tensors of this rank (model_runner.kv_caches). [0.32, private]"""
    return list(_runner(llm).kv_caches)


def reload_weights(llm, weights: Iterable[tuple[str, torch.Tensor]]) -> None:  # noqa: ANN001
    """Full HF tensors through vLLM's own loaders (model_runner.reload_weights,
    checkpoint format). [0.32, private]"""
    _runner(llm).reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)


RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                  "vllm.model_executor.model_loader.reload.inplace",  # [0.32] per-module warnings
                  "vllm.v1.worker.gpu_model_runner")  # [0.26, CUDA build] the same warning


def dispatch_cpu_gemm(layer: torch.nn.Module, *, remove_weight: bool) -> None:
    """vLLM-CPU's per-layer GEMM preparation (packs the weight into a oneDNN /
    sgl handle, or keeps it for zentorch): layers.utils.dispatch_cpu_unquantized_gemm.
    [0.32, private]"""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(layer, remove_weight=remove_weight)


def cpu_packed_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weight copies vLLM-CPU's GEMM dispatch holds outside the
    module's parameters (not torch-visible as parameters). [0.32, private]

    Each linear (and vocab-parallel) layer gets a `cpu_linear` closure: one
    over `handler` holds a oneDNN packed copy (an opaque object, counted as
    the layer's TP-local out x in x itemsize); one over a `packed_weight`
    (sgl) or `zen_weight` tensor counts that tensor unless it is the layer's
    own parameter. The plain fallback (F.linear on the parameter) adds nothing.
    """
    import inspect

    total = 0
    for mod in model.modules():
        fn = getattr(mod, "cpu_linear", None)
        if fn is None or not inspect.isfunction(fn):
            continue
        held = inspect.getclosurevars(fn).nonlocals
        own = {p.untyped_storage().data_ptr() for p in mod.parameters(recurse=False) if p.numel()}
        for v in held.values():
            if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() not in own:
                total += v.untyped_storage().nbytes()
        if "handler" in held:
            rows, cols = _local_weight_shape(mod)
            total += rows * cols * mod.weight.element_size()
    return total


def _local_weight_shape(mod: torch.nn.Module) -> tuple[int, int]:
    """A linear or vocab-parallel layer's TP-local weight shape, whether or not its
    parameter was emptied: column/row-parallel (per partition), replicated (whole,
    e.g. a MoE router), or vocab-parallel. [0.32]"""
    if mod.weight.numel():
        return tuple(mod.weight.shape)
    for rows, cols in (("output_size_per_partition", "input_size_per_partition"),
                       ("num_embeddings_per_partition", "embedding_dim"),
                       ("output_size", "input_size")):
        if getattr(mod, rows, None) and getattr(mod, cols, None):
            return getattr(mod, rows), getattr(mod, cols)
    raise AttributeError(f"{type(mod).__name__}: no weight shape to count its packed copy by")


EXPERT_WEIGHTS = ("w13_weight", "w2_weight")
"""A FusedMoE layer's stacked expert weights (`routed_experts.w13_weight`, ...). [0.32]"""


def install_cpu_experts(layer: torch.nn.Module, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """Installs a FusedMoE layer's experts on vLLM-CPU from raw [E, 2I/T, H] and
    [E, H, I/T] tensors (copied): sets them and re-runs the CPU experts' weight
    preparation (pad I to the kernel's alignment, pre-pack for its grouped GEMM).
    vLLM's own reload re-packs nothing on a second load (`_setup_kernel` copies
    raw weights into the packed storage), so this calls the CPU step itself.
    [0.32, private]"""
    from vllm.model_executor.utils import replace_parameter

    replace_parameter(layer, "w13_weight", w13.clone())
    replace_parameter(layer, "w2_weight", w2.clone())
    layer.quant_method.moe_kernel.fused_experts.process_weights_after_loading(layer)


def expert_shapes(layer: torch.nn.Module) -> tuple[tuple[int, int], tuple[int, int]]:
    """A FusedMoE layer's raw w13 and w2 on this rank, 2-D: [E*2I/T, H], [E*H, I/T]
    (whatever its packed parameters look like). [0.32]"""
    e, ni, h = layer.local_num_experts, layer.intermediate_size_per_partition, layer.hidden_size
    return (e * 2 * ni, h), (e * h, ni)


def load_expert_weight(layer: torch.nn.Module, param: torch.Tensor, full: torch.Tensor,
                       name: str) -> None:
    """vLLM's FusedMoE loader filling `param` ([E, rows, cols] of this TP rank) from
    HF's fused experts tensor `full` ([E, 2I, H] for w13, [E, H, I] for w2), one
    expert and projection at a time, as it loads a per-expert checkpoint. [0.32]"""
    for e in range(full.shape[0]):
        if name.endswith("w13_weight"):
            gate, up = full[e].chunk(2, dim=0)
            layer.weight_loader(param, gate, name, "w1", e)
            layer.weight_loader(param, up, name, "w3", e)
        else:
            layer.weight_loader(param, full[e], name, "w2", e)


def zentorch_gemm() -> bool:
    """Whether vLLM-CPU prepares GEMMs with zentorch, which keeps a reference to
    the weight it was given (sgl and oneDNN pack a copy). [0.32]"""
    from vllm.platforms import current_platform

    zen = getattr(torch.ops, "zentorch", None)
    return current_platform.is_zen_cpu() and zen is not None and hasattr(zen, "zentorch_linear_unary")


def set_weight_attrs(param: torch.Tensor, attrs: dict) -> None:
    """vLLM's weight-loader attributes (output_dim, input_dim) on a parameter. [0.32]"""
    from vllm.model_executor.utils import set_weight_attrs as _set

    _set(param, attrs)


def has_shm_allreduce() -> bool:
    """Whether vLLM's CPU build has its shared-memory collectives (the ops its TP
    groups use: torch.ops._C.init_shm_manager / shm_allreduce). The library is
    the one vLLM loads for this CPU (vllm._C, _C_AVX512 or _C_AVX2, each
    registering torch.ops._C): importing another would abort the process on a
    second registration of the namespace. [0.32, private]"""
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    ops = getattr(torch.ops, "_C", None)
    return hasattr(ops, "init_shm_manager") and hasattr(ops, "shm_allreduce")


def shm_manager(name: str, world: int, rank: int, threads: int,
                barrier: Callable[[], None]) -> int:
    """vLLM-CPU's shared-memory manager over `world` ranks of this host, as its
    `_CPUSHMDistributed` builds one: create this rank's segment /dev/shm/{name}_{rank},
    barrier, map the others', barrier. Returns the handle. [0.32, private]"""
    handle = torch.ops._C.init_shm_manager(name, world, rank, threads)
    barrier()
    torch.ops._C.join_shm_manager(handle, name)
    barrier()
    return handle


def shm_allreduce(handle: int, tensor: torch.Tensor) -> None:
    """In-place sum of `tensor` over the manager's ranks (fp32, bf16, fp16). Each rank
    adds the others' buffers to its own in an order that starts from itself: with 3+
    ranks the rounding, hence the result, differs by rank. [0.32, private]"""
    torch.ops._C.shm_allreduce(handle, tensor)


def shm_all_gather(handle: int, tensor: torch.Tensor, out: torch.Tensor) -> None:
    """Every rank's `tensor` into `out` (contiguous, world x its size, in rank order),
    as vLLM-CPU's `all_gather_into_tensor` does. [0.32, private]"""
    torch.ops._C.shm_all_gather(handle, tensor, out)


def shutdown(llm) -> None:  # noqa: ANN001
    """Stops the in-process engine core (llm_engine.engine_core.shutdown). [0.32]"""
    llm.llm_engine.engine_core.shutdown()


# --------------------------------------------------------------------------
# LoRA adapters from tensors in memory
# --------------------------------------------------------------------------

_TENSOR_REQUEST: type | None = None
_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # LoRAConfig.max_lora_rank's choices


def lora_engine_kwargs(rank: int) -> dict:
    """LLM arguments for one adapter of rank r at a time: the smallest max_lora_rank
    vLLM accepts that holds r. [0.32: LoRAConfig.max_lora_rank is a Literal]

    Raises:
        ValueError: r is above vLLM's largest.
    """
    fits = [m for m in _MAX_LORA_RANKS if m >= rank]
    if not fits:
        raise ValueError(f"model.lora_rank={rank}: vLLM serves LoRA ranks up to "
                         f"{_MAX_LORA_RANKS[-1]}; use sync.lora=merge (vLLM then serves "
                         "merged weights, any rank)")
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 1}


def _tensor_lora_request() -> type:
    """A LoRARequest that carries the adapter itself (PEFT config and tensors), and
    the patch of `WorkerLoRAManager._load_adapter` that builds the adapter from
    them (`LoRAModel.from_lora_tensors`, what its folder load ends in) instead of
    reading `lora_path`. vLLM 0.32 loads adapters from folders only. The request
    reaches the worker unserialised because the engine runs in this process
    (external_launcher). The tensors are cloned: vLLM scales lora_B in place.
    [0.32: LoRARequest, WorkerLoRAManager._load_adapter, _adapter_manager,
    _lora_model_cls, PEFTHelper; verl patches the same method]"""
    global _TENSOR_REQUEST
    if _TENSOR_REQUEST is not None:
        return _TENSOR_REQUEST
    import msgspec
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.request import LoRARequest
    from vllm.lora.worker_manager import WorkerLoRAManager

    class TensorLoRARequest(LoRARequest):
        peft_config: dict = msgspec.field(default_factory=dict)
        lora_tensors: dict = msgspec.field(default_factory=dict)

    folder_load = WorkerLoRAManager._load_adapter

    def load(self, request):  # noqa: ANN001, ANN202
        if not isinstance(request, TensorLoRARequest):
            return folder_load(self, request)
        helper = PEFTHelper.from_dict({**request.peft_config,
                                       "vllm_max_position_embeddings": self.max_position_embeddings})
        helper.validate_legal(self.lora_config)
        model = self._adapter_manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        return self._lora_model_cls.from_lora_tensors(
            lora_model_id=request.lora_int_id,
            tensors={k: v.clone() for k, v in request.lora_tensors.items()},
            peft_helper=helper, device=str(self.device), dtype=self.lora_config.lora_dtype,
            model_vocab_size=self.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None))

    WorkerLoRAManager._load_adapter = load
    _TENSOR_REQUEST = TensorLoRARequest
    return TensorLoRARequest


def swap_lora(llm, old_id: int | None, name: str, new_id: int,  # noqa: ANN001
              tensors: dict[str, torch.Tensor], peft_config: dict):  # noqa: ANN201
    """Replaces the engine's adapter old_id (None: none yet) by one built from
    tensors (PEFT state-dict names) and peft_config (a LoraConfig as a dict);
    returns the request that generation passes to use it. Every rank of the
    engine calls it with the same full tensors; vLLM slices them per TP rank.
    A new name per version: vLLM's prefix cache keys blocks by the adapter's
    name, and a reused name would serve blocks computed with the old one.
    [0.32: LLM.llm_engine.add_lora / remove_lora]"""
    from vllm.lora.request import LoRARequest

    request_cls = _tensor_lora_request()
    if old_id is not None:
        llm.llm_engine.remove_lora(old_id)
    llm.llm_engine.add_lora(request_cls(lora_name=name, lora_int_id=new_id, lora_path="in-memory",
                                        peft_config=peft_config, lora_tensors=tensors))
    return LoRARequest(lora_name=name, lora_int_id=new_id, lora_path="in-memory")
