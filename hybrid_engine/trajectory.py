"""Trajectories and the padded training batch: the data passed between roles.

Job: `Trajectory` is one sampled sequence with response-local fields (one
entry per response token, filled in by rollout, reference and algorithm in
turn); `collate_trajectories` turns a list of them into one `TrainBatch` of
padded full-sequence tensors, rows sorted by length so that micro-batches
(row slices, trimmed to their own longest row) waste little padding.

Invariant (alignment): a trajectory with prompt length P puts response token
j at column P + j, and every per-token field of the batch at [b, t] refers to
*predicting* tokens_BT[b, t] from the prefix tokens_BT[b, :t] (i.e. from the
model's output at position t - 1). So loss_mask_BT[b, P + j] is
traj.loss_mask[j], rollout_logp_BT[b, P + j] is traj.rollout_logp[j], and so
on; column 0 is never a target. Micro-batches are whole rows and carry no
normaliser of their own: the loss normaliser is computed over the whole batch
(`algorithms.loss_normalizer`), so how rows are grouped never changes the loss.

Shape legend: B sequences (rows), T token positions (prompt + response).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["TrainBatch", "Trajectory", "collate_trajectories", "micro_batch_bounds",
           "trajectory_from_json", "trajectory_to_json"]

FloatSeq = Sequence[float] | Tensor


@dataclass(slots=True, kw_only=True)
class Trajectory:
    """One sampled sequence; per-token fields are response-local (length R).

    Attributes:
        prompt_ids: prompt token ids (non-empty).
        response_ids: R response token ids, including environment / tool
            tokens of a multi-turn episode.
        rollout_logp: R log-probs of each response token under the sampling
            engine (0 on env tokens; NaN where the engine was not asked for
            them, `policy.training.logprob_samples`).
        reward: scalar reward of the whole sequence.
        reward_components: named parts of the reward (for metrics).
        loss_mask: R bools, False on env / tool tokens; None = all True.
        advantages: R per-token advantages (filled by the algorithm).
        ref_logp: R reference-policy log-probs (filled by the reference).
        old_logp: R trainer log-probs under the rollout's weights (filled by the
            policy before the first of several updates of a step; else None).
        engine_logp: R log-probs of the response tokens under the rollout engine
            holding the weights the trainer trains with at this step (set by
            the colocated policy's drift scorer when samples can be stale),
            else None: with it the mismatch metric splits into drift and
            numerics.
        values: R critic values of the response positions (filled by the critic's
            scorer; token-level advantage estimators need them), else None.
        returns: R returns the critic trains towards (filled by a token-level
            advantage estimator, GAE), else None.
        rm_score: the reward model's score of the sequence, when a reward
            model on some ranks only scored it beside the other scorers
            (`envs.reward_model.RewardModelScorer`), else None; the reward
            model's environment then takes it instead of scoring again.
        group_id: the prompt group this sample belongs to.
        policy_version: the version of the weights that sampled it (its oldest
            token, when versions differ within it): the RL step counter when
            they did, steps that trained nothing included (its staleness at
            step s is s - policy_version; `async_rollout.max_staleness` bounds it).
        token_versions: R ints, the version that sampled each response token,
            when they may differ within a sequence (partial rollouts' parked
            prefixes; in-flight weight updates), else None (all policy_version).
        info: free-form metadata; always has "degenerate" (bool, default False).
            "installs" (R ints, until `stamp_version`): weight installs since
            the batch was submitted, per token (in-flight updates).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logp: FloatSeq
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    loss_mask: list[bool] | None = None
    advantages: FloatSeq | None = None
    ref_logp: FloatSeq | None = None
    old_logp: FloatSeq | None = None
    engine_logp: FloatSeq | None = None
    values: FloatSeq | None = None
    returns: FloatSeq | None = None
    rm_score: float | None = None
    group_id: int = 0
    policy_version: int = 0
    token_versions: list[int] | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt_ids must be non-empty (column 0 is never a target)")
        if self.loss_mask is None:
            self.loss_mask = [True] * len(self.response_ids)
        self.info.setdefault("degenerate", False)
        for name in ("rollout_logp", "loss_mask"):
            self._check_len(name)

    def _check_len(self, name: str) -> None:
        value = getattr(self, name)
        if value is not None and len(value) != len(self.response_ids):
            raise ValueError(
                f"{name} has {len(value)} entries, response has {len(self.response_ids)}"
            )

    @property
    def degenerate(self) -> bool:
        """True when the sample carries no learning signal (e.g. its group's rewards are equal)."""
        return bool(self.info["degenerate"])

    @property
    def num_tokens(self) -> int:
        """Prompt plus response length."""
        return len(self.prompt_ids) + len(self.response_ids)


def stamp_version(trajs: Sequence[Trajectory], version: int) -> None:
    """Sets each trajectory's policy_version to `version`, the version of the weights
    when its batch was submitted; an in-flight batch's per-token install counts
    ("installs", counted from the submission) become per-token versions (version +
    installs), and its policy_version is its first token's."""
    for t in trajs:
        t.policy_version = version
        installs = t.info.pop("installs", None)
        if installs is not None:
            t.token_versions = [version + i for i in installs]
            t.policy_version += installs[0] if installs else 0


def trajectory_to_json(t: Trajectory) -> dict[str, Any]:
    """t as JSON-able values (tensors as lists; floats round-trip exactly)."""
    return {f.name: _plain(getattr(t, f.name)) for f in dataclasses.fields(t)}


def trajectory_from_json(d: dict[str, Any]) -> Trajectory:
    """Inverse of `trajectory_to_json` (also of a checkpoint whose trajectories kept
    values, returns and token_versions under info)."""
    d = {**d, "info": dict(d.get("info", {}))}
    for key in ("values", "returns", "token_versions"):
        if key in d["info"]:
            d[key] = d["info"].pop(key)
    return Trajectory(**d)


def _plain(v: Any) -> Any:
    if isinstance(v, Tensor):
        return v.tolist()
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def micro_batch_bounds(
    seq_lens_B: Sequence[int], *, micro_batch_size: int | None = None, max_tokens: int | None = None
) -> tuple[tuple[int, int], ...]:
    """Row ranges [start, end) of micro-batches over rows sorted by decreasing length.

    micro_batch_size: fixed row count. max_tokens: greedy, the most rows whose
    padded size rows * seq_lens_B[start] stays <= max_tokens (a row longer
    than max_tokens gets a micro-batch of its own). Neither: one micro-batch.

    Raises:
        ValueError: both given, or a value < 1.
    """
    num_rows = len(seq_lens_B)
    if micro_batch_size is not None and max_tokens is not None:
        raise ValueError("give micro_batch_size or max_tokens, not both")
    if any(v is not None and v < 1 for v in (micro_batch_size, max_tokens)):
        raise ValueError(
            f"micro_batch_size / max_tokens must be >= 1, got {micro_batch_size} / {max_tokens}"
        )
    if max_tokens is None:
        step = micro_batch_size or max(num_rows, 1)
        return tuple((s, min(s + step, num_rows)) for s in range(0, num_rows, step))
    bounds, start = [], 0
    while start < num_rows:
        width = max(int(seq_lens_B[start]), 1)
        end = start + max(1, min(max_tokens // width, num_rows - start))
        bounds.append((start, end))
        start = end
    return tuple(bounds)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainBatch:
    """A padded batch of whole sequences, rows sorted by decreasing length.

    Attributes:
        tokens_BT: int64 [B, T] prompt + response ids, right-padded with pad_id.
        attention_mask_BT: bool [B, T], True on real (prompt and response) tokens.
        position_ids_BT: int64 [B, T], arange(T) on every row (right padding
            needs no offset; real tokens never attend to the padding after them).
        loss_mask_BT: bool [B, T], True where tokens_BT[b, t] is a policy
            response token (not prompt, env/tool, or padding); see the module
            docstring for the alignment.
        advantages_BT: float32 [B, T], 0 outside the loss mask.
        rollout_logp_BT: float32 [B, T], the sampling engine's log-prob of
            tokens_BT[b, t]; 0 outside the response.
        old_logp_BT: float32 [B, T] trainer log-probs under the rollout's
            weights, or None (on-policy: the loss detaches the current ones).
        ref_logp_BT: float32 [B, T] reference log-probs, or None.
        engine_logp_BT: float32 [B, T] the engine's log-probs under the
            trainer's current weights (Trajectory.engine_logp), or None.
        prompt_lens_B: int64 [B]; the response of row b starts at this column.
        seq_lens_B: int64 [B] prompt + response lengths (non-increasing).
        order_B: int64 [B], row b holds trajectory order_B[b] of the collated list.
        bounds: micro-batch row ranges chosen at collate time.
    """

    tokens_BT: Tensor
    attention_mask_BT: Tensor
    position_ids_BT: Tensor
    loss_mask_BT: Tensor
    advantages_BT: Tensor
    rollout_logp_BT: Tensor
    old_logp_BT: Tensor | None = None
    ref_logp_BT: Tensor | None = None
    engine_logp_BT: Tensor | None = None
    prompt_lens_B: Tensor
    seq_lens_B: Tensor
    order_B: Tensor
    bounds: tuple[tuple[int, int], ...]

    @property
    def num_seqs(self) -> int:
        """B."""
        return self.tokens_BT.shape[0]

    @property
    def num_loss_tokens(self) -> int:
        """Tokens the loss sees (sum of loss_mask_BT)."""
        return int(self.loss_mask_BT.sum())

    def rows(self, start: int, end: int) -> TrainBatch:
        """Rows [start, end), columns trimmed to the longest of them (one micro-batch)."""
        width = int(self.seq_lens_B[start:end].max()) if end > start else 1

        def cut(x: Tensor | None) -> Tensor | None:
            return None if x is None else x[start:end, :width]

        names = [f.name for f in dataclasses.fields(self)]
        tensors = {n: cut(getattr(self, n)) for n in names if n.endswith("_BT")}
        rows = {n: getattr(self, n)[start:end] for n in names if n.endswith("_B")}
        return TrainBatch(**tensors, **rows, bounds=((0, end - start),))

    def micro_batches(
        self, micro_batch_size: int | None = None, *, max_tokens: int | None = None
    ) -> Iterator[TrainBatch]:
        """Yields the micro-batches: row slices trimmed to their own longest row.

        With no argument, the split chosen at collate time (`bounds`);
        otherwise recomputed by `micro_batch_bounds`.
        """
        bounds = self.bounds
        if micro_batch_size is not None or max_tokens is not None:
            bounds = micro_batch_bounds(
                self.seq_lens_B.tolist(), micro_batch_size=micro_batch_size, max_tokens=max_tokens
            )
        for start, end in bounds:
            yield self.rows(start, end)

    def padding_fraction(self) -> float:
        """Fraction of the micro-batches' token slots (rows x own width) that is padding."""
        slots = sum((e - s) * int(self.seq_lens_B[s]) for s, e in self.bounds if e > s)
        return 1.0 - int(self.seq_lens_B.sum()) / max(slots, 1)

    def empty_like(self) -> TrainBatch:
        """A one-row micro-batch with no loss token: a rank with fewer micro-batches
        than its peers runs these so that FSDP2's collectives stay in step."""
        row = self.rows(0, 1)
        return dataclasses.replace(row, loss_mask_BT=torch.zeros_like(row.loss_mask_BT),
                                   advantages_BT=torch.zeros_like(row.advantages_BT))

    def per_trajectory(self, x_BT: Tensor) -> list[Tensor]:
        """Response-local slices of a [B, T] tensor, in the collated trajectories' order.

        Args:
            x_BT: [B, T'] with T' >= every row's length (e.g. `Reference.score`'s output).

        Returns:
            list over trajectories i: x_BT[row of i, P_i : P_i + R_i] (length R_i).
        """
        out: list[Tensor] = [x_BT.new_empty(0)] * self.num_seqs
        spans = zip(self.order_B.tolist(), self.prompt_lens_B.tolist(), self.seq_lens_B.tolist())
        for b, (i, p, s) in enumerate(spans):
            out[i] = x_BT[b, p:s]
        return out


def _response_field(
    trajs: Sequence[Trajectory], name: str, *, required: bool
) -> list[Tensor] | None:
    """One response-local float field of every trajectory as 1-D tensors; None when
    optional and absent everywhere."""
    values = [getattr(t, name) for t in trajs]
    missing = sum(v is None for v in values)
    if missing == len(values) and not required:
        return None
    if missing:
        raise ValueError(f"{missing} of {len(values)} trajectories have no {name}")
    out = [torch.as_tensor(v, dtype=torch.float32).reshape(-1) for v in values]
    for t, v in zip(trajs, out):
        if v.numel() != len(t.response_ids):
            raise ValueError(f"{name} has {v.numel()} entries, response has {len(t.response_ids)}")
    return out


def _pad(trajs: Sequence[Trajectory], pad_id: int) -> dict[str, Tensor]:
    """Writes every response-local field at columns [P, P + R) of its row."""
    num_rows, width = len(trajs), max(t.num_tokens for t in trajs)
    fields = {
        "advantages_BT": _response_field(trajs, "advantages", required=False),
        "rollout_logp_BT": _response_field(trajs, "rollout_logp", required=True),
        "ref_logp_BT": _response_field(trajs, "ref_logp", required=False),
        "old_logp_BT": _response_field(trajs, "old_logp", required=False),
        "engine_logp_BT": _response_field(trajs, "engine_logp", required=False),
    }
    out = {k: torch.zeros((num_rows, width)) for k, v in fields.items() if v is not None}
    out.setdefault("advantages_BT", torch.zeros((num_rows, width)))  # not computed yet
    out["tokens_BT"] = torch.full((num_rows, width), pad_id, dtype=torch.int64)
    out["loss_mask_BT"] = torch.zeros((num_rows, width), dtype=torch.bool)
    for b, t in enumerate(trajs):
        p, s = len(t.prompt_ids), t.num_tokens
        out["tokens_BT"][b, :s] = torch.tensor(t.prompt_ids + list(t.response_ids))
        out["loss_mask_BT"][b, p:s] = torch.tensor(t.loss_mask, dtype=torch.bool)
        for k, values in fields.items():
            if values is not None:
                out[k][b, p:s] = values[b]
    # Advantages only count where the loss looks: zero them on env tokens.
    out["advantages_BT"].masked_fill_(~out["loss_mask_BT"], 0.0)
    return out


def collate_trajectories(
    trajs: Sequence[Trajectory],
    *,
    pad_id: int,
    micro_batch_size: int | None = None,
    max_tokens_per_micro_batch: int | None = None,
) -> TrainBatch:
    """Response-local trajectories -> one padded, length-sorted TrainBatch.

    Rows are sorted by decreasing prompt + response length (ties keep list
    order), so a micro-batch of consecutive rows, trimmed to its first row's
    length, pads little: see `TrainBatch.padding_fraction`.

    Args:
        trajs: non-empty list; advantages may be missing on all of them (zeros:
            e.g. scoring before the algorithm ran), ref_logp on all (None).
        pad_id: token id written in padding positions.
        micro_batch_size: rows per micro-batch; or
        max_tokens_per_micro_batch: padded tokens per micro-batch (greedy).

    Returns:
        The TrainBatch (CPU tensors); `order_B` maps rows back to `trajs`.

    Raises:
        ValueError: empty list, mismatched per-token lengths, a field present
            on some trajectories only, or both micro-batch options.
    """
    if not trajs:
        raise ValueError("collate_trajectories needs at least one trajectory")
    order = sorted(range(len(trajs)), key=lambda i: -trajs[i].num_tokens)
    trajs = [trajs[i] for i in order]
    seq_lens = [t.num_tokens for t in trajs]
    bounds = micro_batch_bounds(
        seq_lens, micro_batch_size=micro_batch_size, max_tokens=max_tokens_per_micro_batch
    )
    padded = _pad(trajs, pad_id)
    num_rows, width = padded["tokens_BT"].shape
    seq_lens_B = torch.tensor(seq_lens, dtype=torch.int64)
    return TrainBatch(
        attention_mask_BT=torch.arange(width)[None, :] < seq_lens_B[:, None],
        position_ids_BT=torch.arange(width, dtype=torch.int64).expand(num_rows, width).clone(),
        prompt_lens_B=torch.tensor([len(t.prompt_ids) for t in trajs], dtype=torch.int64),
        seq_lens_B=seq_lens_B,
        order_B=torch.tensor(order, dtype=torch.int64),
        bounds=bounds,
        **padded,
    )
