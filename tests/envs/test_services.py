"""Service reward terms (`envs/services.py`) against real HTTP servers on localhost:
a scoring endpoint that records what it receives and fails on demand, and an
OpenAI-shaped chat-completions server with scripted replies (vLLM's own server
as the judge, on 2 ranks: tests/envs/test_services_train.py). Every failure
scores env.reward_on_timeout and is counted, never fatal, never a hang."""

from __future__ import annotations

import json
import time

import pytest

from hybrid_engine.config import EnvConfig
from hybrid_engine.envs import make_env, reward_terms
from hybrid_engine.metrics import trajectory_metrics
from hybrid_engine.models.tokenizer import build_tokenizer
from hybrid_engine.parallel.dist import free_port
from hybrid_engine.trajectory import Trajectory
from tests.envs.servers import ScoringServer

TOK = build_tokenizer()


@pytest.fixture
def server():  # noqa: ANN201
    s = ScoringServer()
    yield s
    s.close()


@pytest.fixture
def data(tmp_path):  # noqa: ANN201
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "level": i % 3} for i in range(10)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(tmp_path / "d.jsonl")


def _env(data: str, rewards: str, **kw):  # noqa: ANN003, ANN202
    return make_env(EnvConfig(dataset_path=data, eval_dataset_path=data, chat_template="none",
                              rewards=rewards, reward_workers=0, reward_timeout_s=0, **kw), TOK)


def _scored(env, completions):  # noqa: ANN001, ANN202
    out = []
    for prompt, text in zip(env.eval_prompts(10), completions):
        ids = TOK.encode(text).ids
        out.append(Trajectory(prompt_ids=prompt, response_ids=ids, rollout_logp=[0.0] * len(ids),
                              loss_mask=[True] * len(ids)))
    env.score(out)
    return out


def test_the_http_term_posts_batches_and_adds_its_weighted_score(server, data) -> None:
    env = _env(data, "math:1.0,http:0.5", reward_url=server.url + "/ok", service_batch_size=3,
               service_concurrency=1)
    texts = ["0", "2", "wrong", "6", "8", "10", "x", "14", "16", "18"]
    trajs = _scored(env, texts)
    sizes = [len(b["samples"]) for _, b in server.requests]
    assert sizes == [3, 3, 3, 1] and server.most_in_flight == 1  # batch size, one at a time
    first = server.requests[0][1]["samples"][0]
    assert first == {"prompt": "0+0=", "completion": "0", "answer": "0", "columns": {"level": 0}}
    for t, text in zip(trajs, texts):
        assert t.reward_components["http"] == float(len(text))
        assert t.reward == pytest.approx(t.reward_components["math"] + 0.5 * len(text))
    assert trajectory_metrics(trajs)["reward/timeouts"] == 0.0


def test_requests_in_flight_follow_service_concurrency(server, data) -> None:
    env = _env(data, "http", reward_url=server.url + "/ok", service_batch_size=1,
               service_concurrency=4)
    _scored(env, ["1"] * 10)
    assert len(server.requests) == 10 and 2 <= server.most_in_flight <= 4


@pytest.mark.parametrize("path", ["/500", "/bad-json", "/short", "/word", "/slow", "down"])
def test_a_failing_service_scores_the_timeout_value_and_is_counted(server, data, path,
                                                                    caplog) -> None:
    url = f"http://127.0.0.1:{free_port()}/score" if path == "down" else server.url + path
    env = _env(data, "math,http:2", reward_url=url, reward_on_timeout=-1.0,
               service_timeout_s=0.5, service_retries=1, service_batch_size=4)
    t0 = time.monotonic()
    trajs = _scored(env, ["0", "2", "wrong"])
    assert time.monotonic() - t0 < 8  # bounded: timeout x (retries + 1) + backoff
    assert [t.reward_components["http"] for t in trajs] == [-1.0] * 3
    assert [t.reward for t in trajs] == [1.0 - 2, 1.0 - 2, 0.0 - 2]
    assert trajectory_metrics(trajs)["reward/timeouts"] == 3.0
    assert sum("env.reward_url=" in r.message for r in caplog.records) == 1  # said once
    if path == "/500":  # service_retries=1: the request, then one retry
        assert server.paths() == ["/500", "/500"]


def test_service_retries_is_the_number_of_retries(server, data) -> None:
    env = _env(data, "http", reward_url=server.url + "/500", service_retries=0)
    _scored(env, ["1"])
    assert server.paths() == ["/500"]


def test_the_judge_scores_each_sample_from_its_reply(server, data) -> None:
    env = _env(data, "judge:0.5", judge_url=server.url + "/v1", judge_range=(0.0, 5.0),
               judge_on_unparsed=-0.25, judge_max_tokens=7,
               judge_template="Q: {prompt} A: {answer}\nResponse:\n{completion}")
    trajs = _scored(env, ["4", "7", "none"])
    assert [t.reward_components["judge"] for t in trajs] == [0.8, 1.0, -0.25]  # 7 clips at 5
    assert [t.reward for t in trajs] == [0.4, 0.5, -0.125]
    m = trajectory_metrics(trajs)
    assert m["reward/unparsed"] == 1.0 and m["reward/timeouts"] == 0.0
    chats = [b for p, b in server.requests if p == "/v1/chat/completions"]
    assert len(chats) == 3 and {b["model"] for b in chats} == {"listed-judge"}
    assert {b["max_tokens"] for b in chats} == {7} and {b["temperature"] for b in chats} == {0.0}
    assert "Q: 0+0= A: 0\nResponse:\n4" in [b["messages"][0]["content"] for b in chats]


def test_the_judge_model_and_pattern_knobs(server, data, tmp_path) -> None:
    (tmp_path / "t.txt").write_text("Response:\n{completion}")
    env = _env(data, "judge", judge_url=server.url + "/v1", judge_model="mine",
               judge_pattern=r"Score: \d(\d)", judge_template=str(tmp_path / "t.txt"))
    trajs = _scored(env, ["17", "4"])  # group 1: the second digit; "4" has none
    assert [t.reward_components["judge"] for t in trajs] == [0.7, 0.0]
    assert trajectory_metrics(trajs)["reward/unparsed"] == 1.0
    assert {b["model"] for p, b in server.requests if p.endswith("completions")} == {"mine"}


def test_a_judge_that_is_down_scores_the_timeout_value(data) -> None:
    env = _env(data, "judge", judge_url=f"http://127.0.0.1:{free_port()}/v1", judge_model="m",
               reward_on_timeout=-1.0, service_retries=0, service_timeout_s=1)
    trajs = _scored(env, ["1", "2"])
    assert [t.reward_components["judge"] for t in trajs] == [-1.0, -1.0]
    assert trajectory_metrics(trajs)["reward/timeouts"] == 2.0


@pytest.mark.parametrize(("kw", "needle"), [
    ({"rewards": "http", "reward_url": "localhost:8000/score"}, "is not an http(s) URL"),
    ({"rewards": "judge", "judge_url": "ftp://host/v1"}, "env.judge_url='ftp://host/v1' is not"),
    ({"rewards": "http"}, "names http if and only if env.reward_url is set"),
    ({"rewards": "math", "judge_url": "http://h/v1"}, "names judge if and only if"),
    ({"rewards": "judge", "judge_url": "http://h/v1", "judge_pattern": "score"}, "has no group"),
    ({"rewards": "judge", "judge_url": "http://h/v1", "judge_range": (5, 5)}, "needs lo < hi"),
])
def test_bad_service_settings_are_refused_by_the_config(kw, needle) -> None:
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        EnvConfig(**kw)


@pytest.mark.parametrize(("kw", "needle"), [
    ({"rewards": "http:many", "reward_url": "http://h/s"},
     "the weight of 'http' must be a number, got 'many'"),
    ({"rewards": "judge", "judge_url": "http://h/v1", "judge_template": "Rate {prompt}"},
     "needs the placeholder {completion}"),
    ({"rewards": "judge", "judge_url": "http://h/v1", "judge_template": "{completion} {score}"},
     "it has {completion}, {score}"),
])
def test_bad_service_terms_are_refused_before_any_engine(kw, needle) -> None:
    with pytest.raises(ValueError) as e:
        reward_terms(EnvConfig(**kw))
    assert needle in str(e.value)
