"""`hybrid-engine train` on 2 real ranks with an http term (a scoring server on
localhost) and a judge term (vLLM's own OpenAI-compatible server, its CPU
build, serving a tiny model): both show in the metrics, and each sample is
scored exactly once across the ranks, counted by the servers themselves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from hybrid_engine.parallel.dist import free_port
from hybrid_engine.testing import run_job
from tests.envs.servers import ScoringServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _judge_requests(url: str) -> float:
    """Requests vLLM's server finished, from its Prometheus metrics."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("vllm:request_success_total{"))


@pytest.fixture(scope="module")
def judge(tmp_path_factory):  # noqa: ANN201
    """vLLM's OpenAI-compatible server on a tiny model; its base URL."""
    from hybrid_engine.models.tiny import PRESETS, write_tiny_model

    model = write_tiny_model(tmp_path_factory.mktemp("judge") / "m", PRESETS["tiny"])
    port = free_port()
    log = open(model.parent / "serve.log", "w")  # noqa: SIM115 -- closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
         "--port", str(port), "--max-model-len", "512", "--dtype", "float32",
         "--enforce-eager", "--served-model-name", "judge"],
        stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("vLLM's server did not start: "
                                       + (model.parent / "serve.log").read_text()[-3000:])
                time.sleep(1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def test_http_and_judge_terms_score_each_sample_once_on_two_ranks(judge, tmp_path) -> None:
    from hybrid_engine.models.tiny import PRESETS, write_tiny_model

    model = write_tiny_model(tmp_path / "policy", PRESETS["tiny"])
    rows = [{"prompt": f"{i}+{j}=", "answer": str(i + j)} for i in range(6) for j in range(6)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    scorer = ScoringServer()
    try:
        proc = run_job(
            ["train", "--recipe=tiny_grpo_debug", "--no-progress", f"--model.path={model}",
             f"--output_dir={tmp_path / 'run'}", f"--env.dataset_path={tmp_path / 'd.jsonl'}",
             "--env.rewards=http:1.0,judge:0.5", f"--env.reward_url={scorer.url}/ok",
             f"--env.judge_url={judge}/v1", "--env.judge_max_tokens=4",
             "--env.service_batch_size=3", "--rollout.max_tokens=8", "--sync.verify=false",
             "--train.num_steps=2", "--eval.at_start=false", "--eval.at_end=false"],
            2, timeout=300, check=False)
        assert proc.returncode == 0, proc.stdout[-3000:]
        rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        samples = sum(r["samples"] for r in rows)
        assert len(rows) == 2 and samples > 0
        for r in rows:
            assert "reward/http" in r and "reward/judge" in r, sorted(r)
            assert r["reward/timeouts"] == 0.0 and "reward/unparsed" in r
        # each sample once: what the servers counted is the steps' samples, no more
        assert len(scorer.samples()) == samples
        assert _judge_requests(judge) == samples
    finally:
        scorer.close()
