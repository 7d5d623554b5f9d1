"""benchmarks/bench_step.py --quick runs end to end on real jobs (vLLM + FSDP2 over
gloo): wall-clock steps with IQR, phases, the train split from the profiled step,
train MFU against a GEMM peak of the same run, generated tokens/s, tokens per step,
the resolved config, a result file with its table and a chart."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_engine.parallel.precision import resolve_compute_dtype

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_step  # noqa: E402


ACCEPTANCE = ("step_s", "step_s_iqr", "generate_s", "train_s", "sync_s", "train_mfu",
              "matmul_peak_flops", "generated_tok_s", "tokens_per_step")


def test_configs_parse_with_jobs_and_reject_bad_input() -> None:
    args = bench_step._args(["--configs", "tiny:2:separate@2", "qwen2-180m:1", "--jobs", "3"])
    assert args.parsed == [("tiny", 2, "separate", 2, ()), ("qwen2-180m", 1, "colocated", 3, ())]
    assert [c[3] for c in bench_step._args([]).parsed] == [2, 3, 1]  # the budgeted default
    args = bench_step._args(["--configs", "tiny:2@2+train.sharding=grad_op+memory.release=true",
                             "--set", "model.compute_dtype=bfloat16"])
    assert args.parsed == [("tiny", 2, "colocated", 2,
                            ("train.sharding=grad_op", "memory.release=true"))]
    assert args.set == ["model.compute_dtype=bfloat16"]
    for bad in ("tiny:x", "tiny:1:separate", "nope:2", "tiny:2@0", "tiny:2:sideways",
                "tiny:2+sharding", "tiny:2+=1"):
        with pytest.raises(SystemExit):
            bench_step._args(["--configs", bad])
    with pytest.raises(SystemExit):
        bench_step._args(["--set", "no_value"])


def test_workload_sets_the_completion_length_and_its_room(monkeypatch, tmp_path) -> None:
    """Each workload's prompts, K and max_tokens reach the job; `long` raises the recipe's
    max_model_len (128) to fit 256-token completions, and a config's own +KEY=VALUE
    still wins over the workload's setting (it comes later on the command line)."""
    seen = []

    def run(cmd, **kwargs):
        seen.append(cmd)
        raise RuntimeError("stop before launching")

    monkeypatch.setattr(bench_step.subprocess, "run", run)
    monkeypatch.setattr(bench_step, "_model", lambda preset, cache: tmp_path / preset)
    for workload, expect in (("long", ["--rollout.max_model_len=320"]), ("w2", []),
                             ("gpu", ["--rollout.max_model_len=320"])):
        args = bench_step._args(["--workload", workload])
        with pytest.raises(RuntimeError):
            bench_step._run_job(args, "tiny", 2, "separate", ("rollout.max_model_len=400",),
                                tmp_path, tmp_path)
        prompts, k, max_tokens = bench_step.WORKLOADS[workload]
        cmd = seen[-1]
        assert f"--train.prompts_per_step={prompts}" in cmd
        assert f"--rollout.num_samples_per_prompt={k}" in cmd
        assert f"--rollout.max_tokens={max_tokens}" in cmd
        lens = [c for c in cmd if c.startswith("--rollout.max_model_len=")]
        assert lens == [*expect, "--rollout.max_model_len=400"]
        if workload == "gpu":  # a GPU job's engine: level-2 sleep, CUDA graphs
            assert {"--memory.release=true", "--rollout.enforce_eager=false"} <= set(cmd)
    assert bench_step.WORKLOADS["long"][2] + 16 <= 320  # room for the arithmetic prompts
    assert bench_step.WORKLOADS["gpu"][2] + 16 <= 320
    from hybrid_engine.config.recipes import build_config

    overrides = ["rollout.max_model_len=320", "rollout.max_model_len=400"]
    assert build_config("tiny_grpo_debug", overrides=overrides).rollout.max_model_len == 400


def test_reward_varies_so_small_groups_are_never_all_equal() -> None:
    """The hashed reward has 1024 levels in [0, 1]: the same completion scored again
    gets new values (the call counter), and groups of K = 4 are never all-equal here
    (a coin flip would make 1 in 8 so, and those steps would skip training)."""
    ns: dict = {}
    exec(bench_step.REWARD, ns)
    values = [ns["reward"]("1+1=", "same completion", "2") for _ in range(4000)]
    assert all(0.0 <= v <= 1.0 for v in values)
    assert len(set(values)) > 900
    groups = [values[i:i + 4] for i in range(0, len(values), 4)]
    assert not [g for g in groups if len(set(g)) == 1]


def test_wall_steps_are_differences_of_step_ends_and_skip_warmup_and_profiled() -> None:
    rows = [{"step": i, "elapsed_s": float(i * i)} for i in range(1, 6)]  # 1 warm-up, 3 timed
    timed = bench_step._timed({"rows": rows}, warmup=1, steps=3)
    assert [r["step"] for r in timed] == [2, 3, 4]  # step 5 is the profiled one
    assert [r["step_wall_s"] for r in timed] == [4 - 1, 9 - 4, 16 - 9]


def test_first_steps_and_every_config_against_the_first() -> None:
    """Steps 1 and 2 against two median timed steps, the start-up outside the loop,
    and each config's median step over the first config's, with a bootstrap CI."""
    rows = [{"step": i, "elapsed_s": e} for i, e in enumerate([5.0, 8.0, 10.0, 12.0, 14.0, 16.0], 1)]
    job = {"rows": rows, "wall_s": 40.0}
    timed = [bench_step._timed(job, warmup=2, steps=3)]  # steps 3-5: 2 s each
    first = bench_step._first_steps([job], timed)
    assert first == {"first_steps_s_jobs": [[5.0, 3.0]], "first_two_extra_s": 4.0,
                     "start_s": 24.0}
    base = {"config_name": "a", "step_s": 2.0, "train_s": 1.0,
            "step_s_jobs": [[2.0, 2.1, 1.9]] * 2, **first}
    fast = {**base, "config_name": "b", "step_s": 1.0, "train_s": 0.4,
            "step_s_jobs": [[1.0, 1.1, 0.9]] * 2}
    bench_step._step_over_first([base, fast])
    table = bench_step._versus_first([base, fast])
    assert base["step_over_first"] == 1.0 and fast["step_over_first"] == 0.5
    lo, hi = fast["step_over_first_ci"]
    assert lo <= 0.5 <= hi < 1
    assert "| b | 1.000 | 0.500 [" in table and "| 0.400 | 5.00, 3.00 | 4.00 | 24.0 |" in table
    one_warmup = {k: v for k, v in fast.items() if k not in first}  # no steps 1-2 figures
    assert bench_step._versus_first([base, one_warmup]).endswith("| 0.400 | - | - | - |")


def test_train_flops_count_the_body_on_all_tokens_and_the_head_on_loss_tokens() -> None:
    p = bench_step._param_counts("qwen2-180m")
    assert p["lm_head"] == 32000 * 768 and p["body"] == p["total"] - 2 * 32000 * 768
    assert bench_step._train_flops(p, 100, 10) == 6 * p["body"] * 100 + 6 * p["lm_head"] * 10


def test_generate_and_sync_floors_are_bytes_over_bandwidth() -> None:
    cfg = {"rollout": {"tensor_parallel_size": 2},
           "model": {"rollout_dtype": "bfloat16", "master_dtype": "float32"}}
    # 16 decode steps, each reading the TP shard: 1000 params x 2 bytes / T=2
    assert bench_step._gen_floor_s(1000, cfg, 16, 1e3) == pytest.approx(16 * 1000 * 2 / 2 / 1e3)
    # the FLOPs term: 2 x (body + lm_head) per sampled token, over the rollout ranks
    p = {"body": 900, "lm_head": 100, "total": 1100}
    assert bench_step._gen_flops_floor_s(p, 64, 2, 1e3) == pytest.approx(2 * 1000 * 64 / 2 / 1e3)
    # 300 installed bf16 bytes: read as fp32 (600) and written (300)
    row = {"sync_bytes_received": 200.0, "sync_bytes_local": 100.0}
    assert bench_step._sync_floor_s(row, cfg, 1e3) == pytest.approx(0.9)


def test_train_ranks_follow_the_placement() -> None:
    def cfg(tp: int, num_ranks: int = 0) -> dict:
        return {"rollout": {"tensor_parallel_size": tp, "num_ranks": num_ranks}}

    assert bench_step._train_ranks(4, "colocated", cfg(2)) == 4
    assert bench_step._train_ranks(4, "separate", cfg(2)) == 2
    assert bench_step._train_ranks(2, "separate", cfg(1)) == 1
    assert bench_step._train_ranks(4, "separate", cfg(1, num_ranks=1)) == 3


def test_ahead_stats_bound_staleness_and_ratio_to_the_synchronous_config() -> None:
    step = {"step_wall_s": 3.0, "train_s": 2.8, "generate_busy_s": 1.0, "staleness_mean": 1.0,
            "staleness_max": 1.0, "staleness/0": 0.0, "staleness/1": 1.0}
    first = {**step, "staleness_mean": 0.0, "staleness_max": 0.0, "staleness/0": 1.0,
             "staleness/1": 0.0, "generate_busy_s": 3.5, "step_wall_s": 3.5}
    timed = [[first, step, step, step]]
    st = bench_step._ahead_stats(timed, 1)
    assert st["overlap_bound_s"] == 2.8 and st["generate_busy_s"] == 1.0
    assert st["step_over_bound"]["median"] == pytest.approx(3.0 / 2.8)
    assert st["staleness_dist"] == {0: 0.25, 1: 0.75} and st["staleness_max"] == 1.0
    assert bench_step._ahead_stats(timed, 0) == {"max_staleness": 0}
    base = {"preset": "p", "world_size": 2, "placement": "separate", "max_staleness": 0,
            "overrides": ["x=1"], "step_s": 5.0, "step_s_jobs": [[5.0, 5.0, 5.0]]}
    ahead = {**base, **st, "overrides": ["x=1", "async_rollout.max_staleness=1",
                                         "algorithm.behaviour_logp=rollout"],
             "step_s": 3.0, "step_s_iqr": 0.0, "step_s_jobs": [[3.0, 3.0, 3.0]], "train_s": 2.8,
             "generate_s": 0.1, "config_name": "p:2:separate+async_rollout.max_staleness=1"}
    other = {**base, "overrides": ["x=2"], "step_s": 1.0}  # other settings: not its baseline
    table = bench_step._ahead_table([other, base, ahead])
    assert ahead["step_over_synchronous"] == pytest.approx(0.6)
    assert "| p:2:separate+async_rollout.max_staleness=1 | 1 | 3.000 (0.000) | 3.000 (0.000) |" in table
    assert "0.60 (5.000 s)" in table
    assert bench_step._ahead_table([base]) == ""
    # async_rollout.inflight_updates: token staleness and the share of syncs installed in flight;
    # its baseline is still the synchronous config
    inflight = [[first, {**step, "sync_inflight": 0.0},
                 {**step, "sync_inflight": 1.0, "staleness_token_mean": 0.5},
                 {**step, "sync_inflight": 1.0, "staleness_token_mean": 0.7}]]
    st = bench_step._ahead_stats(inflight, 1)
    assert st["installs_inflight"] == pytest.approx(2 / 3)
    assert st["staleness_token_mean"] == pytest.approx((0 + 1 + 0.5 + 0.7) / 4)
    fly = {**ahead, **st, "overrides": [*ahead["overrides"], "async_rollout.inflight_updates=true"],
           "config_name": "fly"}
    table = bench_step._ahead_table([base, ahead, fly])
    assert "| 0.55 (67%) | 0.60 (5.000 s)" in table and "| - | 0.60 (5.000 s)" in table


def test_colocated_burst_is_compared_over_windows_of_k_plus_1_steps() -> None:
    # a colocated k = 1 burst: a 6 s step that generates two batches, then a 2 s one that
    # generates none; k = 0: 5 s each. Medians of single steps would mislead (the burst's
    # [2, 6, 2, 6] has median 4 by luck of the split; [2, 2, 6] would have 2): the windows
    # of 2 steps say 4 against 5 whatever the phase.
    def steps(walls):
        return [{"step_wall_s": w, "train_s": 1.5, "generate_busy_s": 2.0, "staleness_mean":
                 0.5, "staleness_max": 1.0, "staleness/0": 0.5, "staleness/1": 0.5}
                for w in walls]
    base = {"preset": "p", "world_size": 2, "placement": "colocated", "max_staleness": 0,
            "overrides": [], "step_s": 5.0, "step_s_jobs": [[5.0, 5.2, 4.8, 5.0]] * 2}
    jobs = [[6.0, 2.0, 6.0, 2.0, 6.0], [2.0, 6.0, 2.0, 6.0, 2.0]]  # out of phase; 5th: no pair
    st = bench_step._ahead_stats([steps(j) for j in jobs], 1)
    burst = {**base, **st, "overrides": ["async_rollout.max_staleness=1",
                                         "algorithm.behaviour_logp=rollout",
                                         "async_rollout.schedule=burst"],
             "step_s": 2.0, "step_s_iqr": 4.0, "step_s_jobs": jobs, "train_s": 1.5,
             "generate_s": 1.0, "config_name": "burst"}
    table = bench_step._ahead_table([base, burst])
    assert burst["step_cycle_s"] == 4.0 and burst["step_cycle_s_iqr"] == 0.0
    assert burst["step_over_synchronous"] == pytest.approx(4.0 / 5.0)
    lo, hi = burst["step_over_synchronous_ci"]
    assert lo <= 0.8 <= hi and hi < 1.0
    # no overlap bound colocated; the baseline is found through the schedule override
    assert "| 4.000 (0.000) | 1.500 | 2.000 (1.000) | - | - |" in table
    assert "| 0.80 (5.000 s) [" in table


def test_partial_stats_and_table_compare_with_the_config_without_them() -> None:
    step = {"step_wall_s": 2.0, "generate_s": 1.0, "generated_tokens": 900.0,
            "partial/sampled_tokens": 600.0, "partial/parked_groups": 3.0,
            "partial/continued_samples": 2.0, "staleness_mean": 0.5, "staleness_max": 1.0,
            "staleness/0": 0.5, "staleness/1": 0.5}
    st = bench_step._partial_stats([[step, step]], {"max_staleness": 1, "step_token_budget": 700})
    assert st["partial_sampled_tokens"] == 600.0 and st["partial_parked_groups"] == 3.0
    assert st["staleness_dist"] == {0: 0.5, 1: 0.5} and st["max_staleness"] == 0
    base = {"preset": "p", "world_size": 2, "placement": "colocated", "overrides": ["x=1"],
            "config_name": "p:2", "step_s": 4.0, "step_s_iqr": 0.0, "generate_s": 2.0,
            "train_samples": 64.0, "tokens_per_step": {"generated": 1200.0},
            "step_s_jobs": [[4.0] * 3], "generate_s_jobs": [[2.0] * 3],
            "sampled_tok_s_jobs": [[600.0] * 3]}
    partial = {**base, **st, "partial_rollout": True, "config_name": "p:2+partial",
               "overrides": ["x=1", "async_rollout.partial=true", "async_rollout.max_staleness=1",
                             "algorithm.behaviour_logp=rollout", "async_rollout.step_token_budget=700"],
               "step_s": 2.0, "generate_s": 1.0, "train_samples": 48.0,
               "step_s_jobs": [[2.0] * 3], "generate_s_jobs": [[1.0] * 3],
               "sampled_tok_s_jobs": [[600.0] * 3]}
    table = bench_step._partial_table([base, partial])
    assert partial["generate_over_without_partial"] == pytest.approx(0.5)
    assert partial["step_over_without_partial"] == pytest.approx(0.5)
    assert partial["tok_s_over_without_partial"] == pytest.approx(1.0)
    assert "| p:2+partial | 700 | 2.000 (0.000) | 1.000 | 600 | 600 | 48 | 0.0208 | 3 |" in table
    assert bench_step._partial_table([base]) == ""


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("bench_step")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_step.py"), "--quick",
                           f"--out-dir={out}", f"--cache-dir={out / 'models'}"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("| model |")  # the table comes first
    return json.loads(lines[-1]), out


def _check_row(r: dict) -> None:
    assert r["steps_timed"] == 4 and r["steps_trained"] == 4  # hashed reward: all train
    for ph in ("switch_s", "generate_s", "score_s", "train_s", "sync_s", "step_s"):
        assert r[ph] > 0, ph
        assert r[f"{ph}_iqr"] >= 0, ph
    # The wall clock holds the phases: whatever they do not cover is overhead >= 0.
    assert r["overhead_s"] >= 0
    assert r["step_s_iqr"] >= 0 and r["step_s_q1"] <= r["step_s"] <= r["step_s_q3"]
    assert all(len(job) == 4 for job in r["step_s_jobs"])
    assert 0 < r["train_mfu"] < 1 and r["matmul_peak_flops"] > 0
    assert 0 < r["matmul_peak_per_rank_flops"] <= r["matmul_peak_flops"]
    tokens = r["tokens_per_step"]
    assert 200 < tokens["generated"] <= 16 * 16  # w1: 4 prompts x K=4 x <= 16 tokens
    assert tokens["trained"] == tokens["generated"] + tokens["prompt"] and tokens["prompt"] > 0
    assert r["generated_tok_s"] == pytest.approx(tokens["generated"] / r["generate_s"])
    # The controller's own gen_tok_s (median of per-step ratios) tells the same story;
    # the old tok_s (prompt + response over all phases) would be far below.
    assert r["gen_tok_s_median"] == pytest.approx(r["generated_tok_s"], rel=0.5)
    assert r["train_profiled"] == r["world_size"]  # one profile per rank of the one job
    fracs = r["train_compute_frac"] + r["train_comm_frac"] + r["train_optimizer_frac"]
    assert fracs == pytest.approx(1.0, abs=1e-6)
    parts = r["train_compute_s"] + r["train_comm_s"] + r["train_optimizer_s"]
    assert parts == pytest.approx(r["train_step_s"])
    assert r["train_compute_s"] > 0 and r["train_optimizer_s"] > 0
    assert 0 < r["train_step_s"] <= r["train_s"] and r["train_other_s"] >= 0
    # the floor is the MFU's other face; the top ops are shares of the profiled step
    assert r["train_floor_s"] == pytest.approx(r["train_s"] * r["train_mfu"], rel=0.5)
    ops = list(r["train_top_ops"].values())
    assert len(ops) == 10 and ops == sorted(ops, reverse=True) and 0 < sum(ops) <= 1
    if r["world_size"] > 1:
        assert r["train_comm_s"] > 0  # FSDP2 gathers and reduces across the ranks
    # every phase has a floor below it (lower bounds from measured bandwidth and peak)
    assert r["mem_bandwidth_per_rank"] > 1e8
    assert 0 < r["generate_floor_s"] < r["generate_s"] and 0 < r["sync_floor_s"] < r["sync_s"]
    assert r["generate_floor_s"] == max(r["generate_floor_bytes_s"], r["generate_floor_flops_s"])
    assert r["generate_floor_flops_s"] > 0 and r["rollout_peak_per_rank_flops"] > 0
    # rank 0's CPU time per phase reaches the report (its meaning: tests/test_phase_timer.py;
    # shares of the wall are left out here: under load a rank waits in collectives)
    assert r["step_user_s"] > 0 and r["train_user_s"] > 0 and r["step_sys_s"] >= 0
    assert all(r[f"{ph}_{kind}_s"] >= 0 for ph in ("generate", "score", "train", "sync")
               for kind in ("user", "sys"))
    cfg = r["resolved_config"]
    assert cfg["model"]["rollout_dtype"] == "bfloat16"
    assert resolve_compute_dtype(cfg["model"]["compute_dtype"], "cpu") == r["compute_dtype"]
    sync = cfg["sync"]
    assert (sync["method"], sync["bucket_mb"], sync["verify"]) == ("reshard", 64, False)
    assert cfg["rollout"]["num_samples_per_prompt"] == 4 and cfg["train"]["prompts_per_step"] == 4


@pytest.mark.vllm
@pytest.mark.slow
def test_quick_schema_and_consistency(quick) -> None:
    result, _ = quick
    assert set(ACCEPTANCE) <= result.keys()
    rows = result["configs"]
    assert [(r["preset"], r["world_size"], r["placement"]) for r in rows] == [
        ("tiny", 1, "colocated"), ("tiny", 2, "colocated")]
    for r in rows:
        _check_row(r)
    # --quick's N=2 config carries an override: it reaches the job's resolved config
    assert rows[1]["overrides"] == ["train.sharding=grad_op"]
    assert [r["resolved_config"]["train"]["sharding"] for r in rows] == ["auto", "grad_op"]
    assert rows[0]["step_over_first"] == 1.0 and rows[1]["step_over_first"] > 0
    for key in ACCEPTANCE:  # --quick: the headline is the last config
        assert result[key] == rows[-1][key], key


@pytest.mark.vllm
@pytest.mark.slow
def test_quick_result_file_and_chart(quick) -> None:
    result, out = quick
    md = Path(result["result"])
    assert md.parent == out and md.name.startswith("step_cpu_") and md.name.endswith("_quick.md")
    text = md.read_text()
    assert "| tiny | 0.6M | 1 | colocated | - | 1 | 1 x 4 |" in text
    assert "| tiny | 0.6M | 2 | colocated | train.sharding=grad_op | 2 | 1 x 4 |" in text
    assert '"resolved_config"' in text and '"tokens_per_step"' in text
    assert "top 10 ops by self time" in text and "- tiny:1 (train floor " in text
    assert "Each phase against its floor" in text and "| tiny:1 | " in text
    assert "Each config against the first" in text and "| tiny:1 | " in text
    assert "| tiny:2+train.sharding=grad_op | " in text
    assert Path(result["chart"]).stat().st_size > 0


def test_result_header_names_the_cpu_and_its_bf16_matrix_units(monkeypatch) -> None:
    """CPUs of one 'class' differ several-fold in bf16 GEMM peak (AMX or not): every
    result file says which CPU it ran on and whether it has AVX512-BF16 and AMX-BF16."""
    import _common

    info = "model name\t: Test CPU 9000\nflags\t\t: fpu avx512_bf16 sse\n"
    monkeypatch.setattr(_common.Path, "read_text", lambda self, *a, **k: info)
    assert _common.cpu_name() == "Test CPU 9000"
    assert _common.cpu_isa() == "AVX512-BF16 yes, AMX-BF16 no"
    header = _common.result_header("bench_x.py", [])
    if "device cpu" in header:
        assert "(Test CPU 9000, AVX512-BF16 yes, AMX-BF16 no)" in header
