"""rollout.tensor_parallel_size=auto (parallel/rollout_tp.py): the sizes the model and
ranks allow, the memory fit, the cost model's choice on CPU and the smallest fitting
size on CUDA, the config value and its refusals. (On real ranks, the calibration and
a job that runs the chosen size: tests/test_controller.py's GRPO cases with auto.)"""

from __future__ import annotations

import math
import re

import pytest
import torch

from hybrid_engine.config import RunConfig, apply_overrides
from hybrid_engine.models.tiny import PRESETS, TinyModelSpec, hf_config
from hybrid_engine.parallel import rollout_tp
from hybrid_engine.reshard.layouts import model_dims

_GIB = 2**30


def _dims(**kw):  # noqa: ANN003, ANN202
    hf = hf_config(TinyModelSpec(**kw))
    return hf, model_dims(hf)


def test_candidates_divide_the_ranks_a_host_and_the_heads() -> None:
    hf, dims = _dims(num_heads=4, num_kv_heads=2)
    assert rollout_tp.candidates(dims, hf, 4, 4) == [1, 2, 4]
    assert rollout_tp.candidates(dims, hf, 4, 2) == [1, 2]  # 2 ranks a host: TP stays inside
    assert rollout_tp.candidates(dims, hf, 6, 6) == [1, 2]  # 3 and 6 do not divide 4 heads
    assert rollout_tp.candidates(dims, hf, 1, 1) == [1]


def test_a_batch_above_max_num_seqs_takes_waves() -> None:
    """vLLM-CPU decodes at most 256 x T sequences at once: 2048 sequences of a step
    over 4 ranks take 2 waves at every size (256, 512, 1024 rows)."""
    cfg = apply_overrides(RunConfig(), {"train.prompts_per_step": 256,
                                        "rollout.num_samples_per_prompt": 8})
    assert rollout_tp.batch_rows(cfg, 1, 4) == (256, 2)
    assert rollout_tp.batch_rows(cfg, 2, 4) == (512, 2)
    assert rollout_tp.batch_rows(cfg, 4, 4) == (1024, 2)
    assert rollout_tp.batch_rows(apply_overrides(cfg, {"train.prompts_per_step": 2}), 2, 4) == (8, 1)
    costs = rollout_tp.Costs({1: 1e-3, 2: 5e-4}, {1: 0.0, 2: 1e-6}, {1: 2, 2: 1})
    assert costs.step(1, 2) == 2e-3 and costs.step(2, 2) == 5e-4 + 4e-6


@pytest.mark.parametrize(("allreduce_s", "want"), [(1e-3, 1), (1e-6, 2)])
def test_cpu_takes_the_shorter_predicted_step(allreduce_s, want) -> None:
    """read 1 ms at TP 1, 0.5 ms at TP 2; 2 layers x 2 all-reduces at TP 2: 1 ms each
    makes TP 2 4.5 ms (TP 1 wins), 1 us makes it 0.504 ms (TP 2 wins)."""
    costs = rollout_tp.Costs({1: 1e-3, 2: 5e-4}, {1: 0.0, 2: allreduce_s})
    size, why = rollout_tp.choose([1, 2], lambda t: True, costs, layers=2)
    assert size == want
    assert "TP 1 1.00 ms" in why and "4 all-reduces" in why, why


def test_the_smallest_fitting_size_comes_first() -> None:
    """TP 1 would be faster, but its engine does not fit: TP 2."""
    costs = rollout_tp.Costs({1: 1e-3, 2: 5e-4}, {1: 0.0, 2: 1.0})
    size, why = rollout_tp.choose([1, 2], lambda t: t >= 2, costs, layers=2)
    assert size == 2 and "[1] do not fit" in why
    size, why = rollout_tp.choose([1, 2, 4], lambda t: False, None, layers=2)
    assert size == 4 and "no size fits" in why


def _cfg(**sets):  # noqa: ANN003, ANN202
    return apply_overrides(RunConfig(), {"model.rollout_dtype": "bfloat16",
                                         "memory.kv_cache_gib": 1.0, **sets})


def test_pick_measures_on_cpu_only_and_counts_weights_and_kv_cache() -> None:
    """A preset of 180M parameters in bf16 (~0.34 GiB) and a 1 GiB KV cache: a budget
    of 1.2 GiB fits TP 2 (0.17 + 1) but not TP 1 (no measurement: one size left);
    CUDA never measures and takes the smallest fitting size."""
    dims = model_dims(hf_config(PRESETS["qwen2-180m"]))
    weights = rollout_tp.engine_bytes(dims, 1, 2, 0)
    assert 0.3 * _GIB < weights < 0.4 * _GIB
    assert rollout_tp.engine_bytes(dims, 2, 2, _GIB) == weights // 2 + _GIB

    def never():  # noqa: ANN202
        raise AssertionError("measured")

    assert rollout_tp.pick(_cfg(), dims, [1, 2], int(1.2 * _GIB), "cpu", never)[0] == 2
    assert rollout_tp.pick(_cfg(), dims, [1, 2], 8 * _GIB, "cuda", never)[0] == 1
    fast_allreduce = rollout_tp.Costs({1: 2e-2, 2: 1e-2}, {1: 0.0, 2: 1e-6})
    assert rollout_tp.pick(_cfg(), dims, [1, 2], 8 * _GIB, "cpu", lambda: fast_allreduce)[0] == 2
    # fp32 weights count twice: at 1.1 GiB neither fits, and the largest is taken
    assert rollout_tp.pick(_cfg(**{"model.rollout_dtype": "float32"}), dims, [1, 2],
                           int(1.1 * _GIB), "cpu", never)[0] == 2


def test_the_measurements_are_seconds() -> None:
    """The read measurement scales a real GEMM to the share (no timing is compared)."""
    dims = model_dims(hf_config(PRESETS["tiny"]))
    for t in (1, 2):
        s = rollout_tp.measure_read(dims, t, rows=4, dtype=torch.float32)
        assert math.isfinite(s) and 0 < s < 1


def test_one_process_resolves_to_1_and_logs_it(model_dir, caplog) -> None:
    cfg = _cfg(**{"rollout.tensor_parallel_size": "auto"})
    with caplog.at_level("INFO", logger=rollout_tp.__name__):
        out = rollout_tp.with_rollout_tp(cfg, model_dir, torch.device("cpu"))
    assert out.rollout.tensor_parallel_size == 1
    assert "rollout.tensor_parallel_size=auto chose 1 in " in caplog.text
    fixed = _cfg(**{"rollout.tensor_parallel_size": 2})
    assert rollout_tp.with_rollout_tp(fixed, model_dir, torch.device("cpu")) is fixed


def test_the_config_takes_auto_and_refuses_it_outside_colocated() -> None:
    assert _cfg(**{"rollout.tensor_parallel_size": "auto"}).rollout.tensor_parallel_size == "auto"
    with pytest.raises(ValueError, match=re.escape("expected int | one of 'auto', got 'most'")):
        _cfg(**{"rollout.tensor_parallel_size": "most"})
    with pytest.raises(ValueError, match="must be >= 1"):
        _cfg(**{"rollout.tensor_parallel_size": "0"})
    with pytest.raises(ValueError, match="auto needs placement=colocated"):
        _cfg(**{"rollout.tensor_parallel_size": "auto", "placement": "separate"})


def test_preflight_checks_auto_as_tp_1(model_dir, tmp_path) -> None:
    """Before launch auto is checked as TP 1, the most demanding per rank: a KV cache
    that holds one sequence at TP 2 but not at TP 1 is refused."""
    from hybrid_engine.config.recipes import get_recipe
    from hybrid_engine.policy.placements import rank_map
    from hybrid_engine.preflight import preflight

    run = apply_overrides(get_recipe("tiny_grpo_debug"), {
        "model.path": model_dir, "output_dir": str(tmp_path / "run"),
        "rollout.tensor_parallel_size": "auto"})
    preflight(run, rank_map=rank_map, world_size=2, local_world_size=2, resume=False,
              overwrite=False)
    # fp32 K and V of 2 layers x 2 KV heads x 32: 1024 bytes a token at TP 1, 512 at TP 2;
    # a sequence of 128 tokens needs 2 blocks of 128 (one is reserved): 256 KiB vs 128 KiB
    small = apply_overrides(run, {"memory.kv_cache_gib": 200_000 / _GIB})
    with pytest.raises(ValueError, match="memory.kv_cache_gib"):
        preflight(small, rank_map=rank_map, world_size=2, local_world_size=2, resume=False,
                  overwrite=False)
    preflight(apply_overrides(small, {"rollout.tensor_parallel_size": 2}), rank_map=rank_map,
              world_size=2, local_world_size=2, resume=False, overwrite=False)
