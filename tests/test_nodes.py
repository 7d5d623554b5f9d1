"""`torchrun --nnodes=2` on one machine: two agents meet at a c10d rendezvous on
localhost, the second in its own PID namespace, so that, as on two hosts,
neither node's ranks can see the other's processes (`testing.run_nodes`).

- Colocated, `train.sharding=hybrid` with one shard group per node and the
  rollout's TP group inside each node (2 nodes x 2 ranks): the per-step metrics
  equal the same job's on one node of 4 ranks.
- Separate placement, node 0 training and node 1 rolling out (2 x 1): a
  SIGKILL of the rollout rank in generation takes the job down within 60 s
  with one error line naming it (the trainer learns it only from the closed
  connection and the stopped heartbeat), and resuming on 2 nodes reproduces
  the same job's uninterrupted per-step metrics on one node.
- A layout the nodes' ranks cannot hold is one error line for the whole job,
  before any engine starts.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hybrid_engine.testing import run_job, run_nodes, separate_pid_namespaces
from tests.test_faults import _argv, _steps, model_dir  # noqa: F401  (model_dir: a fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
STEPS = 2
COLOCATED = ["--train.sharding=hybrid", "--train.shard_group_size=2",
             "--rollout.tensor_parallel_size=2"]
SEPARATE = ["--placement=separate", "--rollout.num_ranks=1", "--rollout.tensor_parallel_size=1"]


def _job(model: Path, out: Path, layout: list[str], *extra: str) -> list[str]:
    return _argv(model, out, f"--train.num_steps={STEPS}", "--eval.at_end=false", *layout, *extra)


def _reference(model: Path, out: Path, layout: list[str], nproc: int) -> dict[int, dict]:
    proc = run_job(_job(model, out, layout), nproc, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    steps = _steps(out)
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert all(s["skipped_degenerate"] == 0.0 for s in steps.values())  # every step trained
    return steps


def _nodes_ok(runs) -> str:  # noqa: ANN001
    for n, r in enumerate(runs):
        assert r.returncode == 0, f"node {n}:\n{r.stdout[-3000:]}"
    return "".join(r.stdout for r in runs)


def test_two_nodes_hybrid_shards_and_tp_inside_each_node_match_one_node(model_dir, tmp_path):
    ref = _reference(model_dir, tmp_path / "one_node", COLOCATED, 4)
    out = tmp_path / "two_nodes"
    logs = _nodes_ok(run_nodes(["-m", "hybrid_engine.cli", *_job(model_dir, out, COLOCATED)],
                               2, 2, timeout=300, pid_namespaces=separate_pid_namespaces()))
    assert "trainer FSDP2, hybrid over 4 rank(s), vLLM TP=2" in logs
    assert _steps(out) == ref


def test_a_rank_killed_on_one_node_takes_the_job_down_and_it_resumes(model_dir, tmp_path):
    """The rollout rank alone on node 1 is SIGKILLed entering its 2nd generation:
    the trainer on node 0 waits for its batch in a collective that fails on the
    closed connection, and names the rank whose heartbeat stopped."""
    ref = _reference(model_dir, tmp_path / "one_node", SEPARATE, 2)
    out, stamp = tmp_path / "two_nodes", tmp_path / "killed_at"
    isolated = separate_pid_namespaces()
    env = {"HE_FAULT": "rollout:2", "HE_FAULT_RANK": "1", "HE_FAULT_STAMP": str(stamp)}
    killed = run_nodes([str(HERE / "fault_train.py"), *_job(model_dir, out, SEPARATE)], 2, 1,
                       env=env, timeout=300, pid_namespaces=isolated)
    down_s = time.time() - float(stamp.read_text())
    assert all(r.returncode != 0 for r in killed)
    assert down_s < 60, down_s
    errors = [line for r in killed for line in r.stdout.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 1 ("), errors
    if isolated:  # another "host": no pid to watch, only the closed connection and the beat
        assert "closed its connections and stopped beating" in errors[0]
    assert sorted(_steps(out)) == [1]
    _nodes_ok(run_nodes(["-m", "hybrid_engine.cli", *_job(model_dir, out, SEPARATE, "--resume")],
                        2, 1, timeout=300, pid_namespaces=isolated))
    assert _steps(out) == ref


def test_a_layout_the_nodes_cannot_hold_is_one_error_line(model_dir, tmp_path):
    """2 nodes of 1 rank, separate placement: 1 rollout rank cannot hold TP 2.
    Refused before any engine starts, with one line for the whole job."""
    layout = ["--placement=separate", "--rollout.num_ranks=1", "--rollout.tensor_parallel_size=2"]
    runs = run_nodes(["-m", "hybrid_engine.cli", *_job(model_dir, tmp_path / "run", layout)],
                     2, 1, timeout=120, pid_namespaces=separate_pid_namespaces())
    assert all(r.returncode != 0 for r in runs)
    logs = "".join(r.stdout for r in runs)
    errors = [line for line in logs.splitlines() if line.startswith("error: ")]
    assert errors == ["error: rollout.tensor_parallel_size=2 must divide the rollout ranks "
                      "(rollout.num_ranks=1)"], errors
    assert "starting the vLLM engine" not in logs
