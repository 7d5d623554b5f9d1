"""Requests driven through vLLM's engine loop by hand, one engine step at a time.

Job: `EngineRun`, what `LLM.generate` does inside (add_request with DELTA
outputs, then step() while any request is unfinished), opened up so the
caller can act between two engine steps: partial rollouts stop and park
(`VLLMRollout.sample_until`), in-flight updates install weights
(`VLLMRollout._step_loop`), episodes add their next turn as soon as it is
ready (`rollout.agent_loop`).
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
    rollouts stop, in-flight updates install weights, a multi-turn episode's
    next turn is added). Accumulates each request's tokens, log-probs and
    whether it finished, in the order requests were added."""

    def __init__(self, llm: LLM, tag: str, requests: list, params: list,
                 lora_request: object = None) -> None:
        self.engine = vllm_compat.engine_loop(llm)
        self.tag, self.lora_request = tag, lora_request  # tag: unique per engine
        self.ids: list[str] = []
        self.index: dict[str, int] = {}
        self.tokens: list[list[int]] = []
        self.logps: list[list[float]] = []
        self.finished: list[bool] = []
        self.add(requests, params)

    def add(self, requests: list, params: list) -> list[int]:
        """Adds requests (they enter the engine at its next step); their indices."""
        from vllm.sampling_params import RequestOutputKind

        start = len(self.ids)
        for i, (request, p) in enumerate(zip(requests, params, strict=True), start):
            rid = f"{self.tag}-{i}"
            p.output_kind = RequestOutputKind.DELTA
            self.engine.add_request(rid, request, p, lora_request=self.lora_request)
            self.ids.append(rid)
            self.index[rid] = i
            self.tokens.append([])
            self.logps.append([])
            self.finished.append(False)
        return list(range(start, len(self.ids)))

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
