"""Rollout role on vLLM, in SPMD mode: one engine per process for the whole job.

Job: sample K completions per prompt and return their token ids and the
sampled tokens' logprobs. Under torchrun every process builds the engine with
`distributed_executor_backend="external_launcher"` over the world that
torchrun made; all ranks of a tensor-parallel group must call `generate` with
identical arguments (vLLM's SPMD contract).

Separate placement: with `ranks=` only those ranks build an engine, and
vLLM's world is confined to them (`vllm_compat.restrict_world`); the others
never call into this module.

The engine is platform-free: memory between phases and the installation of
re-packed weights go to its backend (`rollout/cpu.py`, `rollout/cuda.py`),
and every private vLLM attribute it needs to `rollout/vllm_compat.py`. Where
a weight sync writes, and how staged weights are installed, is its weight
side (`rollout/weights.py`).

Invariant: it never samples from weights a release discarded
(`weights_valid`), and it never creates or destroys the caller's process
group (vLLM destroys the default group when the engine is deleted, so the
engine lives as long as the process).
"""

from __future__ import annotations

import gc
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hybrid_engine import console
from hybrid_engine.config import MemoryConfig, RolloutConfig
from hybrid_engine.rollout import vllm_compat
from hybrid_engine.rollout.engine_run import EngineRun
from hybrid_engine.rollout.prompt_limit import PromptTooLong
from hybrid_engine.rollout.weights import WeightStaging

if TYPE_CHECKING:
    from vllm import LLM, SamplingParams

__all__ = ["Completions", "VLLMRollout", "scheduling_kwargs"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Completions:
    """K completions for each prompt, flattened prompt-major (index = p * K + k).

    Fields:
        prompt_ids: per prompt, its token ids (after any truncation).
        token_ids: per completion, the sampled token ids.
        logprobs: per completion, the logprob of each sampled token under the
            sampling distribution (temperature applied); NaN for a completion
            whose log-probs were not asked for (`VLLMRollout.logprob_samples`).
        num_samples: K.
        installs: per completion, per token, how many weight installs happened
            in this call before the token was sampled (async_rollout.inflight_updates;
            None when the call ran without an install hook).
    """

    prompt_ids: list[list[int]]
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    num_samples: int
    installs: list[list[int]] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


def scheduling_kwargs(cfg: RolloutConfig) -> dict:
    """vLLM engine keywords of rollout.async_scheduling ('auto': none, vLLM decides)."""
    return {} if cfg.async_scheduling == "auto" else {
        "async_scheduling": cfg.async_scheduling == "true"}


class VLLMRollout(WeightStaging):
    """A vLLM engine colocated with the trainer in this process.

    Args:
        model_path: HF model folder.
        cfg: sampling and engine settings.
        memory: the KV cache size (CPU), the memory share (GPU) and the sleep
            emulation; None = the defaults.
        dtype: dtype of vLLM's weights ("float32", "bfloat16").
        ranks: separate placement: the global ranks that build engines (this
            one among them, contiguous); None = every rank.
        group: a process group over `ranks` (gathers the replicas' completions).
        logprob_samples: completions per prompt whose sampled-token log-probs
            `generate` asks vLLM for (the first ones of each group; the others'
            are NaN); None = all of them.

    Attributes:
        facts: the settings vLLM resolved (`vllm_compat.engine_facts`): the run
            writes them to output_dir/engine.json.
    """

    def __init__(self, model_path: str, cfg: RolloutConfig, *, memory: MemoryConfig | None = None,
                 dtype: str = "bfloat16", ranks: Sequence[int] | None = None,
                 group: object = None, reserve_bytes: int = 0, lora_rank: int = 0,
                 logprob_samples: int | None = None, double_buffer: bool = False) -> None:
        import torch.distributed as dist

        self.ranks = list(ranks) if ranks is not None else None
        self.group = group  # gathers replicas' completions; None = the default group
        world = len(self.ranks) if self.ranks is not None else (
            dist.get_world_size() if dist.is_initialized() else 1)
        if world % cfg.tensor_parallel_size != 0:
            raise ValueError(
                f"rollout.tensor_parallel_size={cfg.tensor_parallel_size} must divide "
                f"the {'rollout ranks' if ranks is not None else 'world size'} {world}"
            )
        self.cfg, self.lora_rank = cfg, lora_rank
        self.logprob_samples = logprob_samples
        # The adapter every request uses (`set_adapter`): None = the base weights alone.
        self.lora_request, self._lora_version = None, 0
        vllm_compat.prepare_process_env()
        vllm_compat.check_version()
        if vllm_compat.is_cpu():
            from hybrid_engine.rollout.cpu import CpuBackend

            self.backend = CpuBackend(memory or MemoryConfig())
        else:
            from hybrid_engine.rollout.cuda import CudaBackend

            self.backend = CudaBackend(memory or MemoryConfig(), reserve_bytes=reserve_bytes)
        # An engine serving adapters never has its base weights rewritten: a release keeps them.
        self.backend.keep_weights = bool(lora_rank)
        self.llm = self._start_engine(model_path, dtype)
        self.facts = vllm_compat.engine_facts(self.llm)
        self.tokenizer = self.llm.get_tokenizer()
        self._init_weights(double_buffer)
        self._kv_released = False  # release_memory() dropped the KV cache
        self.num_truncated = 0
        self._request_serial = 0  # hand-driven request ids are unique per engine

    def _start_engine(self, model_path: str, dtype: str) -> LLM:
        """vLLM's LLM over this world (external_launcher), or over `ranks` alone."""
        import torch.distributed as dist
        from vllm import LLM

        cfg = self.cfg
        kwargs = {**self.backend.engine_kwargs(), "use_tqdm_on_load": console.show_progress()}
        if self.lora_rank:  # one adapter at a time: the policy's newest
            kwargs.update(vllm_compat.lora_engine_kwargs(self.lora_rank))
        if dist.is_initialized():
            kwargs["distributed_executor_backend"] = "external_launcher"
        kwargs.update(scheduling_kwargs(cfg))
        undo = vllm_compat.restrict_world(self.ranks) if self.ranks is not None else (lambda: None)
        # vLLM runs about nine full garbage collections while it starts, then freezes
        # the heap itself; freezing what is alive already (torch, transformers, the
        # trainer) keeps those collections from scanning it: ~1.5 s less per start on
        # 2 CPU cores. Objects stay freed by reference counting as before.
        gc.freeze()
        try:
            return LLM(model=model_path, dtype=dtype, tensor_parallel_size=cfg.tensor_parallel_size,
                       max_model_len=cfg.max_model_len, enforce_eager=cfg.enforce_eager,
                       seed=cfg.seed, logprobs_mode="processed_logprobs", **kwargs)
        finally:
            undo()

    def set_adapter(self, tensors: dict[str, torch.Tensor], peft_config: dict) -> None:
        """Makes every later request use the LoRA adapter of these full tensors
        (PEFT state-dict names) and LoraConfig dict, in place of the previous one,
        loaded from memory (`vllm_compat.swap_lora`). Collective over the engine's
        ranks (each passes the same tensors). Needs an engine built with lora_rank."""
        if not self.lora_rank:
            raise ValueError("set_adapter needs an engine built with lora_rank > 0")
        old = self.lora_request.lora_int_id if self.lora_request is not None else None
        self._lora_version += 1
        self.lora_request = vllm_compat.swap_lora(
            self.llm, old, f"policy-v{self._lora_version}", self._lora_version, tensors,
            peft_config)

    def prompt_ids(self, prompts: Sequence[str | Sequence[int]],
                    max_tokens: Sequence[int] | None = None) -> list[list[int]]:
        """Token ids of each prompt, checked against max_model_len minus that
        prompt's max_tokens (rollout.max_tokens when max_tokens is None).

        Raises:
            PromptTooLong: a prompt past it under rollout.prompt_too_long=reject.
        """
        out = []
        for i, p in enumerate(prompts):
            ids = self.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else list(p)
            limit = self.cfg.max_model_len - self.cfg.max_tokens  # cfg as swapped now
            what = "rollout.max_tokens"
            if max_tokens is not None:
                limit, what = self.cfg.max_model_len - max_tokens[i], f"max_tokens={max_tokens[i]}"
            if len(ids) > limit:
                if self.cfg.prompt_too_long == "reject":
                    raise PromptTooLong(i, f"{len(ids)} tokens, more than rollout.max_model_len - "
                                        f"{what} = {limit} (set rollout.prompt_too_long=truncate "
                                        "to keep its last tokens)")
                ids = ids[-limit:]
                self.num_truncated += 1
            out.append(ids)
        return out

    def generate(
        self, prompts: Sequence[str | Sequence[int]], *, num_samples: int | None = None,
        seed: int = 0, stop: Sequence[str] | None = None, include_stop_str: bool = False,
        max_tokens: int | Sequence[int] | None = None, keys: Sequence[int] | None = None,
        between_steps: Callable[[], bool] | None = None,
    ) -> Completions:
        """Samples K completions per prompt; collective over the whole world.

        Every rank passes the same prompts. With N/T > 1 replicas, replica i
        samples only its contiguous slice of the prompts and the results are
        gathered, so every rank returns all completions.

        Args:
            prompts: texts or token id lists.
            num_samples: K; rollout.num_samples_per_prompt when None.
            seed: per-call seed; completion j of prompt p uses seed
                (cfg.seed, seed, p, j), so runs repeat whatever the batching
                or the number of replicas.
            stop: stop strings for this call, replacing rollout.stop; None
                keeps rollout.stop. token_ids always run through the token
                that completes the stop string (see `_sample`).
            include_stop_str: vLLM's include_stop_str_in_output (affects
                vLLM's output text only, not token_ids; see `_sample`).
            max_tokens: new-token limit for this call: one int for every
                prompt, or one per prompt; None = rollout.max_tokens. A
                prompt's length is checked against max_model_len minus its
                own limit (rollout.prompt_too_long says what happens beyond).
            keys: one per prompt, in place of its position in the seeds
                (cfg.seed, seed, key, j): a multi-turn episode's turn keeps
                its draws whichever episodes share the call.
            between_steps: called after every engine step (in-flight updates): True
                when it installed weights; tokens count installs (`Completions.installs`).

        Returns:
            Completions, prompt-major, in the order of `prompts`.
        """
        self._check_can_sample()
        k = num_samples or self.cfg.num_samples_per_prompt
        limits = self._token_limits(max_tokens, len(prompts))
        if keys is not None and len(keys) != len(prompts):
            raise ValueError(f"keys has {len(keys)} entries, {len(prompts)} prompts")
        prompt_ids = self.prompt_ids(prompts, limits)
        replica, num_replicas = self.replica()
        bounds = [len(prompt_ids) * i // num_replicas for i in range(num_replicas + 1)]
        mine = range(bounds[replica], bounds[replica + 1])
        token_ids, logprobs, installs = self._sample(
            [prompt_ids[p] for p in mine], list(mine), k, seed, stop=stop,
            include_stop_str=include_stop_str,
            max_tokens=None if limits is None else [limits[p] for p in mine], keys=keys,
            between_steps=between_steps,
        )
        if num_replicas > 1:  # every replica's results, as tensors (no pickling)
            token_ids = self._gather_replicas(token_ids, torch.int64)
            logprobs = self._gather_replicas(logprobs, torch.float64)
            installs = None if installs is None else self._gather_replicas(installs, torch.int64)
        if any(math.isnan(x) for i, lps in enumerate(logprobs) if self.wants_logprobs(i % k)
               for x in lps):
            raise RuntimeError("sampled tokens have NaN log-probs: vLLM's weights are not valid "
                               "(discarded by a release and never rewritten?)")
        return Completions(prompt_ids, token_ids, logprobs, k, installs)

    def wants_logprobs(self, j: int) -> bool:
        """Whether completion j of a group gets its sampled-token log-probs."""
        return self.logprob_samples is None or j < self.logprob_samples

    def _check_can_sample(self) -> None:
        if self._kv_released:
            raise RuntimeError("generate() after release_memory(): call restore_memory() first")
        if not self.weights_valid:
            how = "GPU sleep level 2" if self.backend.name == "cuda" else "memory.emulate_gpu_sleep"
            raise RuntimeError(
                f"generate() with discarded weights: release_memory() dropped vLLM's weights "
                f"({how}) and no sync has rewritten them since; sync the trainer's weights first")

    def _token_limits(self, max_tokens: int | Sequence[int] | None,
                      num_prompts: int) -> list[int] | None:
        """generate()'s max_tokens as one limit per prompt (None: rollout.max_tokens)."""
        if max_tokens is None:
            return None
        limits = ([int(max_tokens)] * num_prompts if isinstance(max_tokens, int)
                  else [int(m) for m in max_tokens])
        if len(limits) != num_prompts:
            raise ValueError(f"max_tokens has {len(limits)} entries, {num_prompts} prompts")
        if any(not 1 <= m < self.cfg.max_model_len for m in limits):
            raise ValueError(f"max_tokens must lie in [1, max_model_len="
                             f"{self.cfg.max_model_len}), got {limits}")
        return limits

    def _gather_replicas(self, rows: list[list], dtype: torch.dtype) -> list[list]:
        """Every replica's rows, in replica order (collective over the engine's world)."""
        from hybrid_engine.parallel.dist import all_gather_ragged

        _, num_replicas = self.replica()
        out = all_gather_ragged([torch.tensor(x, dtype=dtype) for x in rows], self.group)
        tp = self.cfg.tensor_parallel_size
        return [x.tolist() for r in range(num_replicas) for x in out[r * tp]]

    def tp_all(self, flag: bool) -> bool:
        """Whether flag holds on every rank of this engine's TP group (an all-reduce
        MIN over vLLM's TP CPU group; collective over the group; flag itself at
        TP = 1)."""
        if self.cfg.tensor_parallel_size == 1:
            return flag
        import torch.distributed as dist

        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=vllm_compat.tp_cpu_group())
        return bool(t.item())

    def replica(self) -> tuple[int, int]:
        """(this rank's replica, number of replicas): TP groups are contiguous ranks
        (of `ranks` under separate placement)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return 0, 1
        tp = self.cfg.tensor_parallel_size
        if self.ranks is not None:
            return self.ranks.index(dist.get_rank()) // tp, len(self.ranks) // tp
        return dist.get_rank() // tp, dist.get_world_size() // tp

    def _sample(self, prompt_ids: list[list[int]], indices: list[int], k: int,
                seed: int, *, stop: Sequence[str] | None = None,
                include_stop_str: bool = False, max_tokens: Sequence[int] | None = None,
                keys: Sequence[int] | None = None,
                between_steps: Callable[[], bool] | None = None,
                ) -> tuple[list[list[int]], list[list[float]], list[list[int]] | None]:
        """Samples this replica's share; stop / include_stop_str / max_tokens
        (one per prompt) and between_steps as in `generate`. Returns token ids,
        log-probs and, with between_steps, each token's install count.

        Stop strings on vLLM 0.32 (measured, tests/rollout/test_episodes.py): a
        completion ended by a stop string has token_ids (and logprobs) through
        the token that completes the string, with include_stop_str_in_output
        True or False alike; the flag only decides whether vLLM's output text
        keeps the string. (vLLM's source: tokens sampled after that one in the
        same step are dropped; an EOS or stop token id, by contrast, is the
        last token id, as tests/rollout/test_engine.py checks.)
        """
        from vllm import TokensPrompt

        stop_strs = list(self.cfg.stop if stop is None else stop)
        requests, params = [], []
        for i, (p, ids) in enumerate(zip(indices, prompt_ids, strict=True)):
            key = p if keys is None else keys[p]
            for j in range(k):
                requests.append(TokensPrompt(prompt_token_ids=ids))
                params.append(self.sampling_params(
                    self.cfg.max_tokens if max_tokens is None else max_tokens[i],
                    hash((self.cfg.seed, seed, key, j)) & 0x7FFFFFFF,
                    logprobs=self.wants_logprobs(j), stop=stop_strs,
                    include_stop_str=include_stop_str))
        if between_steps is not None:
            return self._step_loop(requests, params, between_steps)
        outs = self.llm.generate(requests, params, use_tqdm=False,
                                 lora_request=self.lora_request) if requests else []
        token_ids, logprobs = [], []
        for out in outs:
            comp = out.outputs[0]
            token_ids.append(list(comp.token_ids))
            logprobs.append(vllm_compat.token_logprobs(comp.logprobs, comp.token_ids))
        return token_ids, logprobs, None

    def sampling_params(self, max_tokens: int, seed: int, *, logprobs: bool = True,
                        stop: Sequence[str] = (), include_stop_str: bool = False,
                        ) -> SamplingParams:
        """One request's SamplingParams: rollout's temperature, top-p, top-k and stop
        token ids, with this limit, seed and stop strings (and text only when
        there are stop strings: nothing else reads it, and vLLM would detokenize
        every sampled token twice, text and log-prob entry)."""
        from vllm import SamplingParams

        return SamplingParams(
            n=1, temperature=self.cfg.temperature, top_p=self.cfg.top_p, top_k=self.cfg.top_k,
            max_tokens=int(max_tokens), logprobs=0 if logprobs else None,
            **vllm_compat.logprob_params(), stop=list(stop) or None,
            include_stop_str_in_output=include_stop_str,
            stop_token_ids=list(self.cfg.stop_token_ids) or None, seed=int(seed),
            detokenize=bool(stop))

    def open_run(self, kind: str) -> EngineRun:
        """An empty `EngineRun` on this engine (requests added as they come),
        with the adapter every request uses."""
        self._check_can_sample()
        return EngineRun(self.llm, self._request_tag(kind), [], [], self.lora_request)

    def _request_tag(self, kind: str) -> str:
        """A prefix for hand-driven request ids, unique per engine."""
        self._request_serial += 1
        return f"{kind}-{self._request_serial}"

    def _step_loop(self, requests: list, params: list, between_steps: Callable[[], bool],
                   ) -> tuple[list[list[int]], list[list[float]], list[list[int]]]:
        """`LLM.generate`'s loop run by hand (async_rollout.inflight_updates): after every
        engine step `between_steps()` may install new weights (it returns True when
        it did); the tokens sampled after an install count one more. Same requests,
        seeds and scheduling as `LLM.generate`, so the same tokens without installs."""
        run = EngineRun(self.llm, self._request_tag("inflight"), requests, params,
                        self.lora_request)
        installs: list[list[int]] = [[] for _ in requests]
        done = 0
        while run.running():
            for i, count in run.step():
                installs[i] += [done] * count
            if run.running() and between_steps():
                done += 1
        return run.tokens, run.logps, installs

    def score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
        """The engine's log-prob of every token of each sequence from `starts[i]` on,
        under its current weights (a prefill with prompt log-probs; collective over
        the world like `generate`: replicas score contiguous slices, then gather).

        Prompt tokens skip vLLM's sampling processors, so these are the log-probs
        at temperature 1 over the whole vocabulary: equal to the sampling
        log-probs (processed: after temperature, top-p and top-k) only when
        rollout.temperature is 1 and top_p / top_k are off. A sequence filling max_model_len is scored
        without its last token (vLLM must be able to generate one); that token's
        entry is NaN.
        """
        from vllm import SamplingParams, TokensPrompt

        replica, num_replicas = self.replica()
        bounds = [len(sequences) * i // num_replicas for i in range(num_replicas + 1)]
        mine = range(bounds[replica], bounds[replica + 1])
        limit = self.cfg.max_model_len - 1
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(sequences[i])[:limit]) for i in mine],
            SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False,
                           **vllm_compat.logprob_params()),
            use_tqdm=False, lora_request=self.lora_request) if mine else []
        scores = []
        for i, out in zip(mine, outs, strict=True):
            seq, start = list(sequences[i])[:limit], starts[i]
            lps = vllm_compat.token_logprobs(out.prompt_logprobs[start:], seq[start:])
            scores.append(lps + [math.nan] * (len(sequences[i]) - len(seq)))
        if num_replicas > 1:
            from hybrid_engine.parallel.dist import all_gather_ragged

            lps = all_gather_ragged([torch.tensor(x, dtype=torch.float64) for x in scores],
                                    self.group)
            tp = self.cfg.tensor_parallel_size
            scores = [x.tolist() for r in range(num_replicas) for x in lps[r * tp]]
        return scores

    def sample_until(
        self, prompt_ids: Sequence[Sequence[int]], max_tokens: Sequence[int], seeds: Sequence[int],
        stop_now: Callable[[list[bool], int], bool],
    ) -> tuple[list[list[int]], list[list[float]], list[bool]]:
        """One sample per prompt through vLLM's engine loop, stoppable between
        engine steps (partial rollouts); local to this replica (its TP group
        runs it in lockstep: every decision depends only on the outputs, which
        are the same on every rank of the group).

        The requests go to `LLM.llm_engine` (`vllm_compat.engine_loop`: add_request with DELTA outputs,
        then step() until none is unfinished, as `LLM.generate` does). After
        each engine step `stop_now(finished, tokens)` sees which requests have
        finished and how many tokens were sampled so far; when it returns True
        the unfinished requests are aborted (abort_request frees their KV
        blocks) and come back with the tokens they have. Sampling settings as
        in `_sample`, seeds per request.

        Returns:
            (token ids, their log-probs, finished) per prompt, in order.
        """
        from vllm import TokensPrompt

        if self._kv_released:
            raise RuntimeError("sample_until() after release_memory(): call restore_memory() first")
        if not self.weights_valid:
            raise RuntimeError("sample_until() with discarded weights: sync them first")
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids]
        params = [self.sampling_params(m, seed, stop=self.cfg.stop)
                  for m, seed in zip(max_tokens, seeds, strict=True)]
        run = EngineRun(self.llm, self._request_tag("partial"), requests, params,
                        self.lora_request)
        sampled = 0
        while run.running():
            sampled += sum(count for _, count in run.step())
            if not all(run.finished) and stop_now(run.finished, sampled):
                run.abort_unfinished()
                break
        tokens, logps, finished = run.tokens, run.logps, run.finished
        if any(math.isnan(x) for lp in logps for x in lp):
            raise RuntimeError("sampled tokens have NaN log-probs: vLLM's weights are not valid")
        return tokens, logps, finished

    # --- memory between phases ------------------------------------------------

    def release_memory(self) -> int:
        """Frees what the rollout does not need while the trainer runs.

        GPU: vLLM sleep level 2 (KV cache and weights dropped). CPU, where vLLM
        has no sleep mode: the KV cache storage is resized to 0 (weights stay:
        vLLM-CPU cannot drop them); with memory.emulate_gpu_sleep the weights
        are lost as on a GPU. When the weights are lost, weights_valid turns
        False until a sync rewrites them. An engine built with lora_rank keeps
        its base weights (GPU: sleep level 1, which moves them to host memory
        and back; CPU: never discarded): only adapters are synced into it.
        Returns the bytes actually released (0 if already released).
        """
        if self._kv_released:
            return 0
        freed, weights_lost = self.backend.release(self.llm)
        self._kv_released = True
        if weights_lost:
            self.weights_valid = False
        return freed

    def wake_weights(self) -> None:
        """GPU: maps the weights again before a sync writes them (their contents are
        still lost); a no-op when awake, and on CPU."""
        self.backend.wake_weights(self.llm)

    def restore_memory(self) -> int:
        """Re-allocates what release_memory freed, before generation. Returns bytes.

        GPU: wakes the weights too if no sync woke them (their contents stay
        invalid: weights_valid says so), then the KV cache."""
        if not self._kv_released:
            return 0
        self._kv_released = False
        grown = self.backend.restore(self.llm)
        self.llm.reset_prefix_cache()  # the cached blocks' contents are gone
        return grown

    def weight_bytes(self) -> int:
        """Bytes of the engine's weights on this rank, the copies vLLM-CPU's
        GEMMs pack away from the parameters included (on a GPU: 0 while they
        sleep)."""
        return self.backend.weight_bytes(self._model())

    def kv_cache_bytes(self) -> int:
        """Bytes the KV cache holds on this rank now (0 while released on CPU)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in vllm_compat.kv_cache_tensors(self.llm)}
        return sum(storages.values())

    def kv_blocks(self) -> tuple[int, int]:
        """(tokens per KV block, number of blocks) vLLM made of its KV budget."""
        cache = vllm_compat.cache_config(self.llm)
        return int(cache.block_size), int(cache.num_gpu_blocks or 0)

    def shutdown(self) -> None:
        """Tears the engine down; idempotent.

        vLLM's teardown destroys its model-parallel groups AND the default
        process group, so call this after the job's last collective. Without
        it, the same teardown runs at interpreter exit and fails if the caller
        already destroyed the default group.
        """
        llm = getattr(self, "llm", None)
        if llm is not None:
            vllm_compat.shutdown(llm)
            self.backend.shutdown()
