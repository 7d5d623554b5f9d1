"""memory.release=auto (policy/memory.py): a training phase's growth is measured
for real (a CPU allocation shows up in it), the rule releases only when that growth
does not fit, every figure the decision logs agrees with RSS deltas of a real engine
and trainer within 10%, and a real 2-rank job releases the KV cache in no training
phase when there is room, in every phase when memory.budget is too small; the same
budget makes train.sharding=auto pick `replicate` or `full`."""

from __future__ import annotations

import pytest

from hybrid_engine.policy.memory import MemoryFigures, ReleasePolicy, cpu_free_bytes, needs_release
from hybrid_engine.testing import run_ranks


def test_rule_releases_unmeasured_and_when_the_growth_does_not_fit() -> None:
    assert needs_release(None, 10 * 2**30)  # nothing measured yet
    assert not needs_release(2**30, 2 * 2**30)
    assert needs_release(2**30, 2**30)  # the margin (x1.1 + 64 MiB) does not fit
    # Before the first phase, the layout's estimate decides, and the log says so;
    # then the measured growth.
    p = ReleasePolicy("auto", budget=0.9, first_estimate=2**20)
    assert not p.should_release()
    assert "1.0 MiB (optimizer state included), estimated from the layout" in \
        p.figures.describe("here")
    p.growths = [2**50]
    assert p.should_release()
    assert ReleasePolicy("auto", budget=0.9, first_estimate=2**50).should_release()
    engine = MemoryFigures(50 * 2**20, 2**30, None, None, False, 0)
    assert "(weights 50 with packed GEMM copies, KV cache 1024)" in engine.describe("x")
    assert "(weights 50, KV cache 1024)" in engine.describe("x", packed=False)  # CUDA


def test_the_growth_leaves_out_what_the_phase_kept() -> None:
    """A phase that keeps 128 MiB (as the first keeps the optimizer state it creates,
    counted as used from then on) and frees 256 MiB more grows by the 256."""
    import torch

    kept = []
    p = ReleasePolicy("auto", trainer=lambda: sum(t.nbytes for t in kept))
    p.training_started()
    kept.append(torch.ones(32 * 2**20))
    buf = torch.ones(64 * 2**20)
    del buf
    p.training_ended()
    assert abs(p.phase_growth / 2**28 - 1) < 0.1
    p.growths.append(100)
    assert p.phase_growth == p.growths[0]  # the largest so far


def test_fixed_modes_never_measure_or_decide() -> None:
    for mode, release in [("true", True), (True, True), ("false", False), (False, False)]:
        p = ReleasePolicy(mode)
        p.training_started()
        p.training_ended()
        assert p.should_release() is release and p.phase_growth is None
    with pytest.raises(ValueError, match="'auto', 'true' or 'false'"):
        ReleasePolicy("sometimes")


def test_budget_scales_the_free_share() -> None:
    assert cpu_free_bytes(0.9, 1) > cpu_free_bytes(0.9, 2) > cpu_free_bytes(0.01, 2)
    assert cpu_free_bytes(0.01, 1) < 0  # this process alone uses more than 1% of RAM


def test_auto_measures_a_real_transient_allocation() -> None:
    """A 256 MiB buffer touched and freed inside the phase is its measured growth."""
    import torch

    p = ReleasePolicy("auto", budget=0.9)
    assert p.should_release()  # unmeasured
    p.training_started()
    buf = torch.ones(64 * 2**20)  # 256 MiB, every page written
    del buf
    p.training_ended()
    assert abs(p.phase_growth / 2**28 - 1) < 0.1
    assert not p.should_release()  # 256 MiB fits in 90% of this machine's RAM
    small = ReleasePolicy("auto", budget=0.01)
    small.growths = list(p.growths)
    assert small.should_release()


@pytest.mark.gpu
def test_auto_measures_a_real_transient_allocation_on_cuda() -> None:
    """On a GPU the growth is the allocator's peak above the phase's start; the free
    figure is what mem_get_info and the allocator's cache leave."""
    import torch

    p = ReleasePolicy("auto", device=torch.device("cuda"))
    p.training_started()
    buf = torch.ones(64 * 2**20, device="cuda")  # 256 MiB
    del buf
    p.training_ended()
    assert abs(p.phase_growth / 2**28 - 1) < 0.1
    assert not p.should_release() and p.figures.free <= torch.cuda.mem_get_info()[1]


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
        "rollout.num_samples_per_prompt": 4, "rollout.max_tokens": 8, "train.num_steps": 3,
        "train.prompts_per_step": 4, "checkpoint_every": 0, "eval.at_start": False, "eval.at_end": False,
        "memory.release": "auto", "memory.budget": budget,
        "train.sharding": "auto"})
    job = Job(cfg, progress=False)
    rank = dist.get_rank()
    try:
        summary = job.run()
        growth = job.actor.phases.release.phase_growth
        layout = job.actor.trainer.train_cfg.sharding
        # what the trainer keeps, in units of this rank's parameters (fp32 master)
        params = sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes
                     for p in job.actor.trainer.module.parameters())
        kept = job.actor.phases.release.figures.trainer_kept / params
    finally:
        job.shutdown()
    hist = [h for h in summary["history"] if h["step"] > 0]
    assert all(not h["skipped_degenerate"] for h in hist)  # every step trained
    synced = sum(h["sync_bytes_received"] for h in summary["history"])
    return [h["mem_released_bytes"] for h in hist] + [growth, rank, layout, synced, kept]


@pytest.mark.vllm
@pytest.mark.slow
def test_auto_keeps_the_engine_resident_when_the_trainer_fits(tmp_path) -> None:
    from hybrid_engine.models.tiny import PRESETS, write_tiny_model

    model = str(write_tiny_model(tmp_path / "tiny", PRESETS["tiny"]))
    for budget, expect_every_step in [(0.9, False), (0.01, True)]:
        out = run_ranks(_released_per_step, 2, model, str(tmp_path / f"run{budget}"), budget,
                        timeout=400)
        for r in out:
            released, growth, layout, synced, kept = r[:3], r[3], r[5], r[6], r[7]
            # parameters and AdamW's two moments; replicated, DDP's gradient buckets too
            assert kept == pytest.approx(3.0 if expect_every_step else 4.0, rel=1e-3)
            # train.sharding=auto: replicated when it fits (the sync then moves nothing
            # between ranks), fully sharded when nothing fits
            assert (layout, synced == 0) == (("full", False) if expect_every_step
                                             else ("replicate", True))
            assert growth is not None  # measured from the first phase on
            if expect_every_step:
                assert released[0] > 0 and all(b == released[0] for b in released)
            else:  # the layout's estimate fits from the first phase: nothing freed, nothing regrown
                assert released == [0.0, 0.0, 0.0]


def _resident_kib(fields: tuple[str, ...] = ("RssAnon", "RssShmem")) -> int:
    """This process's resident KiB: by default anonymous and shared memory (no file
    pages: the shared libraries an engine start maps are not its data)."""
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            status[key] = rest
    return sum(int(status[k].split()[0]) for k in fields)


def _figures_against_rss(model_dir: str, kv_gib: float) -> dict:
    """One engine and one trainer on this rank, built as the colocated actor builds
    them, with this process's RSS read around each step; the release policy's
    figures beside those deltas."""
    import ctypes
    import threading
    import time

    from hybrid_engine.algorithms import policy_loss_fn
    from hybrid_engine.config import AlgorithmConfig, MemoryConfig, ModelConfig, RolloutConfig, TrainConfig
    from hybrid_engine.roles.trainer import Trainer
    from hybrid_engine.rollout.engine import VLLMRollout
    from tests.roles.test_trainer import make_trajs, rank_batch

    out = {}
    trainer = Trainer(model_dir, TrainConfig(), ModelConfig())
    rss = _resident_kib()
    rollout = VLLMRollout(model_dir, RolloutConfig(max_model_len=64, max_tokens=8, enforce_eager=True),
                          memory=MemoryConfig(kv_cache_gib=kv_gib), dtype="float32")
    out["engine_rss"] = (_resident_kib() - rss) * 1024
    rss = _resident_kib()
    rollout.release_memory()
    out["released_rss"] = (rss - _resident_kib()) * 1024
    rss = _resident_kib()
    rollout.restore_memory()
    out["restored_rss"] = (_resident_kib() - rss) * 1024
    policy = ReleasePolicy("auto", budget=0.9,
                           engine=lambda: (rollout.weight_bytes(), rollout.kv_cache_bytes()),
                           trainer=trainer.kept_bytes)
    policy.should_release()
    out["first"] = policy.figures
    batch = rank_batch(make_trajs(16, 8192))
    samples, stop = [], threading.Event()

    def sample() -> None:
        while not stop.is_set():  # all pages, as the policy's VmHWM counts them
            samples.append(_resident_kib(("VmRSS",)))
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample)
    start, start_all = _resident_kib(), _resident_kib(("VmRSS",))
    policy.training_started()
    sampler.start()
    trainer.train_step(batch, policy_loss_fn(AlgorithmConfig()))
    stop.set()
    sampler.join()
    policy.training_ended()
    out["peak_rss"] = (max(samples) - start_all) * 1024
    # What the phase kept, once the C allocator has given back the pages it freed
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    out["trainer_rss"] = (_resident_kib() - start) * 1024
    policy.should_release()
    out["second"], out["growths"] = policy.figures, policy.growths
    with open("/proc/meminfo") as f:
        info = {k: int(v.split()[0]) * 1024 for k, _, v in (ln.partition(":") for ln in f)}
    out["free"] = 0.9 * info["MemTotal"] - (info["MemTotal"] - info["MemAvailable"])
    out["weights_in_file"] = sum(p.nbytes for p in trainer.module.parameters())
    rollout.shutdown()
    return out


@pytest.mark.vllm
@pytest.mark.slow
def test_logged_figures_agree_with_rss(tmp_path) -> None:
    """The figures memory.release=auto logs against this rank's RSS deltas, within 10%:
    the engine's resident bytes (weights with vLLM-CPU's packed GEMM copies, and a
    1 GiB KV cache, which a release frees and a restore regrows), what the trainer's
    first phase adds to what it keeps (AdamW's moments), the phase's growth beyond
    that (against a peak sampled every 0.5 ms, which can only miss the top: -10% to
    +25%), and the free budget."""
    from hybrid_engine.models.tiny import PRESETS, write_tiny_model

    model = str(write_tiny_model(tmp_path / "small", PRESETS["small"]))
    out = run_ranks(_figures_against_rss, 1, model, 1.0, timeout=400)[0]
    first, second = out["first"], out["second"]

    def near(figure: float, measured: float) -> bool:
        return abs(figure / measured - 1) < 0.1

    assert near(first.engine_weights + first.engine_kv, out["engine_rss"])
    assert near(first.engine_kv, out["released_rss"]) and near(first.engine_kv, out["restored_rss"])
    # The weights, vLLM-CPU's packed GEMM copies included: at least the checkpoint's
    # bytes, at most the engine start's RSS growth less its KV cache (which also holds
    # its runtime buffers and the code it loaded)
    assert out["weights_in_file"] <= first.engine_weights <= out["engine_rss"] - first.engine_kv
    assert near(second.trainer_kept - first.trainer_kept, out["trainer_rss"])  # AdamW's moments
    assert not first.measured and second.measured and out["growths"] == [second.phase_growth]
    # the phase's rise above its start, less what it kept; the sampled peak can only
    # miss the top (a sampler preempted on a loaded machine missed 11%)
    sampled = out["peak_rss"] - out["trainer_rss"]
    assert 0.9 * sampled < second.phase_growth < 1.25 * sampled, (second.phase_growth, sampled)
    assert near(second.free, out["free"])
    text = second.describe("here")
    assert "packed GEMM copies" in text and "measured on this rank" in text
