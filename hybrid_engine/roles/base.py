"""The roles' interfaces, as typing.Protocols: what the controller may call.

Job: state the colocation contract between roles in one place, small enough
to read at a glance. Implementations: `roles.trainer.Trainer`,
`roles.reference.Reference`, the policies in `policy/`, the environments in
`envs/`, the scorers in `roles.scorers`; the controller, the job and tests
depend on these Protocols, never on an implementation's extras.

Invariant: roles exchange dataclasses (`Trajectory`, `TrainBatch`,
`Completions`) and tensors with documented shapes, not untyped dicts; only
metrics travel as `dict[str, float]`. Methods documented as collective must be
called by every rank, in the same order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import Tensor
    from torch.distributed.tensor import DTensor

    from hybrid_engine.algorithms.losses import LossFn, StepLoss
    from hybrid_engine.parallel.placement import Placement
    from hybrid_engine.trajectory import TrainBatch, Trajectory

__all__ = ["Algorithm", "Checkpointer", "Environment", "JobPolicy", "Layout", "Learner", "Pending",
           "Policy", "Reference", "Scorer", "Trainer", "layout_of"]

# Which layout holds a colocated device: the engine with its memory ("inference")
# or the trainer, with the engine's memory released where configured ("training").
Layout = Literal["inference", "training"]


def layout_of(role: object) -> Layout | None:
    """The layout a role's calls need (its `layout` attribute): "training" for a
    forward on the trainer's side (reference, critic, reward model), "inference"
    for one on the engine (the drift scorer); None, when it has none, runs in
    either (a rule-based reward)."""
    return getattr(role, "layout", None)


class Pending(Protocol):
    """A generation started ahead of its step (`Policy.collect_async`)."""

    def result(self) -> tuple[list[Trajectory], float]:
        """(the unscored trajectories, seconds the engine spent on them); collective."""
        ...


@runtime_checkable
class Policy(Protocol):
    """The policy in whatever placement (`policy.colocated.HybridActor`: colocated;
    `policy.separate.SeparatePolicy`: trainer and rollout ranks apart): what the
    controller calls. All collective."""

    def collect(self, env: Environment, prompts: Sequence[Sequence[int]], *, num_samples: int,
                seed: int, sampling: Mapping[str, Any] | None = None) -> list[Trajectory]:
        """Unscored trajectories, K per prompt (single- or multi-turn)."""
        ...

    def collect_async(self, env: Environment, prompts: Sequence[Sequence[int]], *,
                      num_samples: int, seed: int) -> Pending:
        """`collect` started now and finished by `result()` (async_rollout.max_staleness > 0)."""
        ...

    def train_step(self, trajs: Sequence[Trajectory], loss: StepLoss) -> dict[str, float]:
        """The step's updates on the trajectories (each rank its slice)."""
        ...

    def sync_weights(self) -> dict[str, float]:
        """Makes the sampling layout hold the trained weights."""
        ...

    def switch_to(self, layout: Layout) -> None:
        """Gives this device to `layout`: "inference" brings the engine's memory
        back (and the trainer's weights, if a release discarded them); "training"
        releases the engine's memory where configured. A no-op where the
        placement keeps the layouts on different devices."""
        ...

    def rollout_metrics(self) -> dict[str, float]:
        """The generation's own metrics since the last call (e.g. partial rollouts' pool)."""
        ...

    def rollout_state(self) -> dict | None:
        """What the generation keeps between steps (parked partial rollouts), JSON-able."""
        ...

    def load_rollout_state(self, state: dict | None) -> None:
        """Restores what `rollout_state` returned."""
        ...


class JobPolicy(Policy, Protocol):
    """What the job needs of a policy besides the controller's calls (`job.Job`,
    `job.make_policy`): its model, tokenizer and persistence, and the roles that
    run beside its trainer. All methods collective."""

    model_path: str
    tokenizer: Any
    pad_id: int
    placement: Placement  # which ranks hold which role, and their groups
    trainer: Any  # the FSDP2 `roles.trainer.Trainer` on training ranks, else None
    engine_facts: dict  # what vLLM resolved, on every rank

    def drift_scorer(self) -> Scorer | None:
        """The scorer splitting the mismatch into drift and numerics, where the
        placement and settings make one; else None."""
        ...

    def save(self, path: Any, *, extra: dict | None = None, critic: Any = None) -> None: ...

    def load(self, path: Any, *, critic: Any = None) -> dict | None: ...

    def export_hf(self, path: Any, dtype: Any = None) -> None: ...

    def export_adapter(self, path: Any) -> None: ...

    def shutdown(self) -> None:
        """After the job's last collective (the engine's teardown destroys the group)."""
        ...


class Scorer(Protocol):
    """A role that adds to the trajectories before the reward (reference log-probs,
    critic values, the drift scorer, a placed reward model's scores); collective. Its `layout` attribute, when
    it has one, names the layout the controller switches to first (`layout_of`)."""

    def score(self, trajs: Sequence[Trajectory]) -> None: ...


class Checkpointer(Protocol):
    """Saves the job (policy, critic, ...) with the controller's state (collective)."""

    def save(self, step: int, extra: dict) -> None: ...


class Learner(Protocol):
    """A role that trains after the policy each step (the critic), in the
    training layout; collective."""

    def train_step(self, trajs: Sequence[Trajectory]) -> dict[str, float]: ...


@runtime_checkable
class Environment(Protocol):
    """The task: prompts in, rewards out; never sees logits. An environment whose
    score() runs a model (a reward model) says `layout = "training"`."""

    def sample_prompts(self, num_prompts: int) -> list[list[int]]:
        """The next num_prompts prompts, as token ids."""
        ...

    def eval_prompts(self, num_prompts: int) -> list[list[int]]:
        """Held-out prompts (the same list every call)."""
        ...

    def state_dict(self) -> dict:
        """Position of the prompt stream (for resume)."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Restores a position saved by `state_dict`."""
        ...

    def score(self, trajs: Sequence[Trajectory]) -> None:
        """Fills each trajectory's reward (and reward_components)."""
        ...


@runtime_checkable
class Algorithm(Protocol):
    """Advantages and the loss; knows neither the task nor the layout.

    Attributes:
        loss: what the trainer takes (`algorithms.losses.StepLoss`): the
            per-micro-batch LossFn (contract in `algorithms.losses`), the
            aggregation it was built with, whose whole-step normaliser the
            trainer computes, and whether the entropy enters with grad.
    """

    loss: StepLoss

    def compute_advantages(self, trajs: Sequence[Trajectory]) -> dict[str, float]:
        """Fills per-token advantages and info["degenerate"] of every trajectory;
        returns metrics."""
        ...

    def prompts_wanted(self, trajs: Sequence[Trajectory], rounds: int) -> int:
        """More prompts to generate before training, given the step's scored
        trajectories after rounds generate rounds (0 = train now)."""
        ...

    def select(self, trajs: Sequence[Trajectory]) -> list[Trajectory]:
        """The trajectories to train on; [] skips the step (no signal)."""
        ...


@runtime_checkable
class Trainer(Protocol):
    """FSDP2 forward/backward/step; knows no loss formula (all collective)."""

    def train_step(
        self, batch: TrainBatch, loss_fn: LossFn, *, loss_agg: str = "token_mean",
        loss_agg_constant: float | None = None, entropy_grad: bool = False,
        advance_lr: bool = True,
    ) -> dict[str, float]:
        """One optimizer step on this rank's rows of the global batch; global metrics."""
        ...

    def compute_logprobs(self, batch: TrainBatch) -> tuple[Tensor, Tensor]:
        """(logp_BT, entropy_BT) under the current weights, no grad."""
        ...

    def state_dict_shards(self) -> dict[str, DTensor]:
        """HF name -> this rank's sharded parameter, for the weight sync (not collective)."""
        ...


@runtime_checkable
class Reference(Protocol):
    """Frozen reference policy (collective)."""

    def score(self, batch: TrainBatch) -> Tensor:
        """ref_logp_BT, aligned like TrainBatch's per-token fields."""
        ...
