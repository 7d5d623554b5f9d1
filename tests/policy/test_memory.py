"""memory.release=auto (policy/memory.py): the trainer's transient peak is
measured for real (a CPU allocation shows up in it), the rule releases only when that
peak does not fit, and a real 2-rank job releases the KV cache in its first training
phase only when there is room, in every phase when memory.budget is too small;
the same budget makes train.sharding=auto pick `replicate` or `full`."""

from __future__ import annotations

import pytest

from hybrid_engine.policy.memory import ReleasePolicy, cpu_free_bytes, needs_release
from hybrid_engine.testing import run_ranks


def test_rule_releases_unmeasured_and_when_the_peak_does_not_fit() -> None:
    assert needs_release(None, 10 * 2**30)  # nothing measured yet
    assert not needs_release(2**30, 2 * 2**30)
    assert needs_release(2**30, 2**30)  # the margin (x1.1 + 64 MiB) does not fit
    # Before the first phase, the layout's estimate decides; then the measured peak.
    p = ReleasePolicy("auto", budget=0.9, first_estimate=2**20)
    assert not p.should_release()
    p.trainer_peak = 2**50
    assert p.should_release()
    assert ReleasePolicy("auto", budget=0.9, first_estimate=2**50).should_release()


def test_fixed_modes_never_measure_or_decide() -> None:
    for mode, release in [("true", True), (True, True), ("false", False), (False, False)]:
        p = ReleasePolicy(mode)
        p.training_started()
        p.training_ended()
        assert p.should_release() is release and p.trainer_peak is None
    with pytest.raises(ValueError, match="'auto', 'true' or 'false'"):
        ReleasePolicy("sometimes")


def test_budget_scales_the_free_share() -> None:
    assert cpu_free_bytes(0.9, 1) > cpu_free_bytes(0.9, 2) > cpu_free_bytes(0.01, 2)
    assert cpu_free_bytes(0.01, 1) < 0  # this process alone uses more than 1% of RAM


def test_auto_measures_a_real_transient_allocation() -> None:
    """A 256 MiB buffer touched and freed inside the phase is the measured peak."""
    import torch

    p = ReleasePolicy("auto", budget=0.9)
    assert p.should_release()  # unmeasured
    p.training_started()
    buf = torch.ones(64 * 2**20)  # 256 MiB, every page written
    del buf
    p.training_ended()
    assert 250 * 2**20 <= p.trainer_peak < 400 * 2**20  # less what the phase kept
    assert not p.should_release()  # 256 MiB fits in 90% of this machine's RAM
    small = ReleasePolicy("auto", budget=0.01)
    small.trainer_peak = p.trainer_peak
    assert small.should_release()


def _agree_on_release() -> bool:
    import torch

    p = ReleasePolicy("auto", device=torch.device("cuda", torch.cuda.current_device()))
    return p.should_release()  # all-reduced over the default (NCCL) group


@pytest.mark.gpu
def test_auto_agrees_over_nccl() -> None:
    """The release decision is one all-reduce over the ranks: under NCCL its flag
    must be a device tensor (a CPU one raises: no CPU backend)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"gpu: needs 2 CUDA devices, {torch.cuda.device_count()} present")
    assert run_ranks(_agree_on_release, 2, backend="nccl", timeout=120) == [True, True]


def _released_per_step(model_dir: str, out_dir: str, budget: float) -> list[float]:
    import torch.distributed as dist

    from hybrid_engine.config import apply_overrides
    from hybrid_engine.config.recipes import get_recipe
    from hybrid_engine.job import Job
    from tests.test_controller import _register_digits

    _register_digits()
    cfg = apply_overrides(get_recipe("tiny_grpo_debug"), {
        "model.path": model_dir, "output_dir": out_dir, "env.name": "test_digits",
        "rollout.num_samples_per_prompt": 4, "rollout.max_tokens": 8, "train.num_steps": 4,
        "train.prompts_per_step": 4, "checkpoint_every": 0, "eval.at_start": False, "eval.at_end": False,
        "memory.release": "auto", "memory.budget": budget,
        "train.sharding": "auto"})
    job = Job(cfg, progress=False)
    rank = dist.get_rank()
    try:
        summary = job.run()
        peak = job.actor.phases.release.trainer_peak
        layout = job.actor.trainer.train_cfg.sharding
    finally:
        job.shutdown()
    hist = [h for h in summary["history"] if h["step"] > 0]
    assert all(not h["skipped_degenerate"] for h in hist)  # every step trained
    synced = sum(h["sync_bytes_received"] for h in summary["history"])
    return [h["mem_released_bytes"] for h in hist] + [peak, rank, layout, synced]


@pytest.mark.vllm
@pytest.mark.slow
def test_auto_keeps_the_engine_resident_when_the_trainer_fits(tmp_path) -> None:
    from hybrid_engine.models.tiny import PRESETS, write_tiny_model

    model = str(write_tiny_model(tmp_path / "tiny", PRESETS["tiny"]))
    for budget, expect_every_step in [(0.9, False), (0.01, True)]:
        out = run_ranks(_released_per_step, 2, model, str(tmp_path / f"run{budget}"), budget,
                        timeout=400)
        for r in out:
            released, peak, layout, synced = r[:4], r[4], r[6], r[7]
            # train.sharding=auto: replicated when it fits (the sync then moves nothing
            # between ranks), fully sharded when nothing fits
            assert (layout, synced == 0) == (("full", False) if expect_every_step
                                             else ("replicate", True))
            assert peak is not None  # measured from the first phase on
            if expect_every_step:
                assert released[0] > 0 and all(b == released[0] for b in released)
            else:  # the layout's estimate fits from the first phase: nothing freed, nothing regrown
                assert released == [0.0, 0.0, 0.0, 0.0]
