"""Requests driven through vLLM's engine loop by hand, one engine step at a time.

Job: `EngineRun`, what `LLM.generate` does inside (add_request with DELTA
outputs, then step() while any request is unfinished), opened up so the
caller can act between two engine steps: partial rollouts stop and park
(`VLLMRollout.sample_until`), in-flight updates install weights
(`VLLMRollout._step_loop`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybrid_engine.rollout import vllm_compat

if TYPE_CHECKING:
    from vllm import LLM

__all__ = ["EngineRun"]


class EngineRun:
    """Requests driven through vLLM's engine loop by hand (`vllm_compat.engine_loop`:
    add_request with DELTA outputs, then step() while any is unfinished, as
    `LLM.generate` does), so the caller can act between engine steps (partial
    rollouts stop, in-flight updates install weights). Accumulates each
    request's tokens, log-probs and whether it finished, in request order."""

    def __init__(self, llm: LLM, tag: str, requests: list, params: list,
                 lora_request: object = None) -> None:
        from vllm.sampling_params import RequestOutputKind

        self.engine = vllm_compat.engine_loop(llm)
        self.ids = [f"{tag}-{i}" for i in range(len(requests))]  # tag: unique per engine
        for rid, request, p in zip(self.ids, requests, params, strict=True):
            p.output_kind = RequestOutputKind.DELTA
            self.engine.add_request(rid, request, p, lora_request=lora_request)
        self.index = {rid: i for i, rid in enumerate(self.ids)}
        self.tokens: list[list[int]] = [[] for _ in self.ids]
        self.logps: list[list[float]] = [[] for _ in self.ids]
        self.finished = [False] * len(self.ids)

    def running(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> list[tuple[int, int]]:
        """One engine step; (request index, new tokens) of each request it advanced."""
        new = []
        for out in self.engine.step():
            i, comp = self.index[out.request_id], out.outputs[0]
            self.tokens[i] += comp.token_ids
            self.logps[i] += vllm_compat.token_logprobs(comp.logprobs, comp.token_ids)
            self.finished[i] = out.finished
            new.append((i, len(comp.token_ids)))
        return new

    def abort_unfinished(self) -> None:
        """Aborts the unfinished requests (frees their KV blocks); they keep what
        earlier steps returned."""
        self.engine.abort_request([rid for rid, f in zip(self.ids, self.finished) if not f])
