"""The colocated phase machine (`policy/phases.py`) with a fake engine, no vLLM.

The fake engine counts its release, wake and restore calls, holds a weights
version and a `weights_valid` flag, and samples only what it holds: a release
may drop its weights (as GPU sleep level 2 does; vLLM-CPU keeps them), and a
sample asserts that the KV cache is there and the weights are valid. Each test
walks the transitions the colocated actor makes in an RL step (generate ->
[reference] -> train -> sync) and checks that every sample sees the trainer's
current weights, with the fewest releases, wakes and syncs.
"""

from __future__ import annotations

from collections import Counter

import pytest

from hybrid_engine.policy.phases import Phases

_RELEASED = 1 << 20


class FakeEngine:
    """The engine's side of the phases: memory and weights, counted."""

    def __init__(self, *, drops_weights: bool = False) -> None:
        self.drops_weights = drops_weights
        self.weights_valid, self.version, self.kv = True, 0, True
        self.calls: Counter[str] = Counter()

    def release_memory(self) -> int:
        self.calls["release"] += 1
        self.kv = False
        if self.drops_weights:
            self.weights_valid, self.version = False, None
        return _RELEASED

    def wake_weights(self) -> None:
        self.calls["wake"] += 1

    def restore_memory(self) -> None:
        self.calls["restore"] += 1
        self.kv = True

    def install(self, version: int) -> dict[str, float]:
        self.calls["sync"] += 1
        self.weights_valid, self.version = True, version
        return {"sync_s": 0.0}

    def sample(self) -> int:
        assert self.kv, "sampled without a KV cache"
        assert self.weights_valid, "sampled discarded weights"
        return self.version


class FakeOffload:
    """`OptimizerOffload`'s flag and moves, counted."""

    def __init__(self) -> None:
        self.offloaded = False
        self.calls: Counter[str] = Counter()

    def offload(self) -> int:
        self.calls["offload"] += 1
        self.offloaded = True
        return 1

    def reload(self) -> int:
        self.calls["reload"] += 1
        self.offloaded = False
        return 1


class Actor:
    """The colocated actor's use of the phases (`policy/colocated.py`), on fakes:
    the trainer is a weights version."""

    def __init__(self, *, drops_weights: bool = False, offload: bool = False,
                 release: bool = True) -> None:
        self.engine = FakeEngine(drops_weights=drops_weights)
        self.offload = FakeOffload() if offload else None
        self.version = 0
        self.phases = Phases(self.engine, lambda: self.engine.install(self.version),
                             self.offload, release=release)

    def generate(self) -> int:
        self.phases.to_rollout()
        self.phases.check_rollout()
        return self.engine.sample()

    def train_step(self) -> None:
        self.phases.to_train()
        assert self.offload is None or not self.offload.offloaded, "stepped a parked optimizer"
        self.version += 1
        self.phases.trainer_weights_changed()

    def step(self, reference: object | None = None) -> int:
        """One RL step as the controller calls it; returns the version sampled."""
        sampled = self.generate()
        if reference is not None:  # the controller's switch before a trainer-side scorer
            self.phases.to_train()
            reference.score([])
        self.train_step()
        self.phases.sync()
        return sampled


class FakeReference:
    """A trainer-side role: records the layout and the engine's KV while it scores."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine, self.seen = engine, []

    def score(self, trajs: list) -> None:  # noqa: ARG002
        self.seen.append(self.engine.kv)


@pytest.mark.parametrize("drops_weights", [False, True])
def test_a_step_samples_the_current_weights_with_one_release_and_one_sync(drops_weights) -> None:
    a = Actor(drops_weights=drops_weights)
    assert a.phases.describe() == "layout=inference weights=valid optimizer=device"
    sampled = [a.step() for _ in range(3)]
    assert sampled == [0, 1, 2]  # each step samples the weights the last one trained
    assert a.engine.calls == {"release": 3, "wake": 3, "sync": 3, "restore": 2}
    assert a.phases.layout == "training" and a.phases.weights == "valid"
    assert a.phases.released_bytes == _RELEASED
    assert a.generate() == 3 and a.engine.calls["sync"] == 3  # synced: no second sync


@pytest.mark.parametrize("drops_weights", [False, True])
def test_a_reference_scores_in_the_training_layout_within_the_steps_release(drops_weights) -> None:
    a = Actor(drops_weights=drops_weights)
    ref = FakeReference(a.engine)
    assert [a.step(ref) for _ in range(2)] == [0, 1]
    assert ref.seen == [False, False]  # the engine had released its KV cache
    assert a.engine.calls["release"] == 2  # the train step found the layout already switched


def test_the_optimizer_is_parked_while_the_engine_holds_the_device() -> None:
    a = Actor(offload=True)
    a.step()
    assert a.offload.offloaded and a.phases.optimizer == "host"  # the sync parked it
    assert a.generate() == 1 and a.offload.offloaded
    a.train_step()  # reloaded before the step (train_step asserts it)
    assert a.offload.calls == {"offload": 1, "reload": 1}  # parked once, by the sync
    assert a.phases.describe() == "layout=training weights=stale optimizer=device"


def test_a_train_step_without_a_sync_makes_the_next_generate_sync() -> None:
    """An embedding trainer calls train_step then generate: the invalidation
    (`trained`) makes the generate sync, also where the engine kept its weights."""
    a = Actor()
    a.generate()
    a.train_step()
    assert a.phases.weights == "stale"
    assert a.generate() == 1 and a.engine.calls["sync"] == 1
    a.phases.trainer_weights_changed()  # e.g. a checkpoint load in the inference layout
    assert a.phases.weights == "stale"
    with pytest.raises(RuntimeError, match="weights=stale"):
        a.phases.check_rollout()
    assert a.generate() == 1 and a.engine.calls["sync"] == 2


def test_after_a_forgotten_invalidation_dropped_weights_still_resync() -> None:
    """A caller that changes the trainer's weights and forgets `trained()`: where
    the release dropped the engine's weights, the engine's own flag makes them
    "lost", sampling is refused before `to_rollout`, and `to_rollout` syncs."""
    a = Actor(drops_weights=True)
    a.generate()
    a.phases.to_train()
    a.version += 1  # no trained()
    assert a.phases.weights == "lost"
    with pytest.raises(RuntimeError, match="weights=lost"):
        a.phases.check_rollout()
    assert a.generate() == 1 and a.engine.calls["sync"] == 1


def test_no_release_keeps_the_engine_resident() -> None:
    a = Actor(release=False)
    assert [a.step() for _ in range(2)] == [0, 1]
    assert a.engine.calls == {"wake": 2, "sync": 2, "restore": 1}  # restore is a no-op there
    assert a.phases.released_bytes == 0


@pytest.mark.parametrize("drops_weights", [False, True])
def test_a_checkpoint_from_the_inference_layout_returns_to_it(drops_weights) -> None:
    """`optimizer_on_device` with a parked state: through the training layout and
    back (resyncing dropped weights), the state parked again after the block."""
    a = Actor(drops_weights=drops_weights, offload=True)
    a.step()
    a.generate()
    with a.phases.optimizer_on_device():
        assert a.phases.layout == "training" and a.phases.optimizer == "device"
    assert a.phases.layout == "inference" and a.phases.optimizer == "host"
    assert a.phases.weights == "valid" and a.engine.sample() == 1
    assert a.engine.calls["sync"] == 1 + drops_weights


def test_a_checkpoint_right_after_a_sync_keeps_the_training_layout() -> None:
    a = Actor(offload=True)
    a.step()  # ends in the training layout, synced, optimizer parked
    with a.phases.optimizer_on_device():
        assert a.phases.optimizer == "device"
    assert a.phases.layout == "training" and a.engine.calls["release"] == 1
