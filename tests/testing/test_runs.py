"""The multi-rank harness itself: results, failures, hangs and crashes."""

from __future__ import annotations

import os
import sys
import textwrap
import time

import pytest

from hybrid_engine.testing import RankError, run_in_subprocess, run_ranks, run_torchrun


def _all_reduce_rank():
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), os.environ["OMP_NUM_THREADS"]


def _fail_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    dist.barrier()  # the other ranks wait for rank 1 forever


def _hang_on_last_rank():
    import torch.distributed as dist

    if dist.get_rank() == dist.get_world_size() - 1:
        time.sleep(3600)
    return dist.get_rank()


def _crash_rank_zero():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        os._exit(7)
    dist.barrier()


def _process_info(x):
    import torch.distributed as dist

    return x * 2, dist.is_initialized(), os.getpid()


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_results_come_back_by_rank(world_size):
    out = run_ranks(_all_reduce_rank, world_size, timeout=60)
    total = world_size * (world_size + 1) / 2
    assert [o[:3] for o in out] == [(r, world_size, total) for r in range(world_size)]


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_failing_rank_surfaces_its_traceback(world_size):
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_fail_on_rank_one, world_size, timeout=60)
    msg = str(info.value)
    assert msg.startswith("rank 1 failed first")
    assert "ValueError: boom from rank one" in msg
    assert "_fail_on_rank_one" in msg  # the traceback, not just the message
    assert time.monotonic() - t0 < 30  # ranks stuck in the barrier were killed


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_hung_rank_fails_within_timeout(world_size):
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_hang_on_last_rank, world_size, timeout=6)
    assert time.monotonic() - t0 < 20
    msg = str(info.value)
    assert msg.startswith(f"rank(s) [{world_size - 1}] did not finish within 6 s")
    assert "_hang_on_last_rank" in msg  # the hung rank's stack, dumped into its log


def test_crashed_rank_is_reported_with_exit_code():
    t0 = time.monotonic()
    with pytest.raises(RankError, match="exited with code 7"):
        run_ranks(_crash_rank_zero, 2, timeout=60)
    assert time.monotonic() - t0 < 30


def test_subprocess_is_fresh_and_has_no_process_group():
    value, initialized, pid = run_in_subprocess(_process_info, 21, timeout=60)
    assert value == 42 and not initialized and pid != os.getpid()


def test_local_functions_are_rejected():
    def local():
        return 1

    with pytest.raises(ValueError, match="module-level"):
        run_in_subprocess(local)


def test_torchrun_script(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.ones(1) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        print(f"rank={dist.get_rank()} sum={t.item():.0f}")
        dist.destroy_process_group()
    """))
    out = run_torchrun([str(script)], nproc=2, timeout=120).stdout
    assert "rank=0 sum=3" in out and "rank=1 sum=3" in out


def test_torchrun_failure_raises_with_output(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text("raise SystemExit('bad script ' + __import__('os').environ['RANK'])\n")
    with pytest.raises(RankError, match="bad script"):
        run_torchrun([str(script)], nproc=2, timeout=120)


def test_torchrun_timeout_kills_the_job(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import time\ntime.sleep(3600)\n")
    t0 = time.monotonic()
    with pytest.raises(RankError, match="did not finish within 3 s"):
        run_torchrun([str(script)], nproc=2, timeout=3)
    assert time.monotonic() - t0 < 30


def _return_tensor():
    import torch

    return {"t": torch.arange(5) * (1 + int(os.environ["RANK"]))}


def test_tensors_come_back_after_the_rank_exits():
    outs = run_ranks(_return_tensor, 2, timeout=60)
    assert [o["t"].tolist() for o in outs] == [[0, 1, 2, 3, 4], [0, 2, 4, 6, 8]]
