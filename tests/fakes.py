"""Recording fakes of the controller's roles (no engine, no ranks): an environment,
a policy and an algorithm with the methods `Controller` calls, for fast tests of
the loop's schedule (tests/test_controller.py, tests/policy/test_async.py)."""

from __future__ import annotations

from hybrid_engine.trajectory import Trajectory


class FakeEnv:
    """Prompts [n] from a counter (checkpointed); the reward is the prompt's parity."""

    def __init__(self) -> None:
        self.next = 0

    def sample_prompts(self, n: int) -> list[list[int]]:
        self.next += n
        return [[p] for p in range(self.next - n, self.next)]

    def eval_prompts(self, n: int) -> list[list[int]]:
        """Held-out prompts: the same n every time, outside the training counter's range."""
        return [[-1 - p] for p in range(n)]

    def score(self, trajs) -> None:  # noqa: ANN001
        for t in trajs:
            t.reward = float(t.prompt_ids[0] % 2)

    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, d: dict) -> None:
        self.next = d["next"]


class FakePolicy:
    """Records each generation pass (its prompts, seed and the weights' version);
    K samples per prompt, prompt-major, with the env's group ids left at 0."""

    def __init__(self) -> None:
        self.version, self.passes = 0, []

    def collect_async(self, env, prompts, *, num_samples, seed):  # noqa: ANN001, ANN201
        from hybrid_engine.policy.ahead import Generated

        self.passes.append(([p[0] for p in prompts], seed, self.version))
        trajs = [Trajectory(prompt_ids=list(p), response_ids=[seed % 97] * (1 + p[0] % 3),
                            rollout_logp=[-1.0] * (1 + p[0] % 3))
                 for p in prompts for _ in range(num_samples)]
        return Generated(trajs, 0.5)

    def collect(self, env, prompts, *, num_samples, seed, sampling=None):  # noqa: ANN001, ANN201, ARG002
        return self.collect_async(env, prompts, num_samples=num_samples, seed=seed).result()[0]

    def train_step(self, trajs, loss_fn=None) -> dict:  # noqa: ANN001
        self.version += 1
        return {}

    def sync_weights(self) -> dict:
        return {}

    def switch_to(self, layout) -> None:  # noqa: ANN001
        pass

    def rollout_metrics(self) -> dict:
        return {}

    def rollout_state(self) -> None:
        return None

    def load_rollout_state(self, state) -> None:  # noqa: ANN001
        assert state is None


class FakeAlgorithm:
    """Wants one refill round of 1 prompt after a first round holding a prompt that
    ends in 6 (dynamic sampling; here steps 2 and 5)."""

    def compute_advantages(self, trajs) -> dict:  # noqa: ANN001
        return {}

    def prompts_wanted(self, trajs, rounds: int) -> int:  # noqa: ANN001
        return int(rounds == 1 and any(t.prompt_ids[0] % 10 == 6 for t in trajs))

    def select(self, trajs):  # noqa: ANN001, ANN201
        return trajs

    loss = None
