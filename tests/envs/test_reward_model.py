"""Reward from a reward model: scores equal an unpadded HF forward of each sequence
alone (1 process and 2 gloo ranks), the env's reward wiring, non-finite scores."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hybrid_engine.config import EnvConfig
from hybrid_engine.envs import ArithmeticEnv, RewardError, make_env
from hybrid_engine.envs.base import encode
from hybrid_engine.envs.reward_model import RewardModel, RewardModelEnv, write_tiny_reward_model
from hybrid_engine.models.tiny import TinyModelSpec
from hybrid_engine.models.tokenizer import EOS_TOKEN_ID, build_tokenizer
from hybrid_engine.roles.base import Environment
from hybrid_engine.testing import run_ranks
from hybrid_engine.trajectory import Trajectory

EOS = EOS_TOKEN_ID
# Lengths 1..40, a trailing EOS (= pad id: HF's own pooling would skip it), EOS mid-sequence.
SEQS = [[1, 2, 3, EOS], [5] * 17, [7, 8], list(range(40)), [EOS, 9, EOS], [42], [3, 1, 4, 1, 5]]


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory) -> str:
    return str(write_tiny_reward_model(tmp_path_factory.mktemp("rm"), TinyModelSpec(seed=3)))


def hf_scores(path: str, seqs: list[list[int]]) -> torch.Tensor:
    """Plain transformers forward of each sequence alone, no padding: the last token."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    model.config.pad_token_id = None  # batch of 1: read position -1, even on an EOS
    with torch.no_grad():
        return torch.stack([model(input_ids=torch.tensor([s])).logits[0, 0] for s in seqs])


@pytest.fixture(scope="module")
def ref(rm_path) -> torch.Tensor:
    return hf_scores(rm_path, SEQS)


def test_single_process_scores_equal_unpadded_forward(rm_path, ref):
    rm = RewardModel(rm_path, micro_batch_size=3)
    assert rm.mesh is None and ref.abs().min() > 1e-4  # non-trivial scores
    torch.testing.assert_close(rm.score(SEQS), ref, atol=1e-5, rtol=0)
    rm.micro_batch_size = 1  # micro-batching never changes a score
    torch.testing.assert_close(rm.score(SEQS), ref, atol=1e-5, rtol=0)
    assert rm.score([]).shape == (0,)
    with pytest.raises(ValueError, match="sequence 1 has 0 tokens"):
        rm.score([[1], []])


def _rank_checks(path: str, seqs: list[list[int]]) -> dict:
    from torch.distributed.tensor import DTensor, Shard

    rm = RewardModel(path, micro_batch_size=3)  # 7 rows: 4 + 3 -> 2 vs 1 micro-batches
    scores = rm.score(seqs)
    one = rm.score(seqs[:1])  # rank 1 has no row: dummy forward only
    params = list(rm.module.parameters())
    env = make_env(EnvConfig(name="arithmetic", reward_model_path=path), build_tokenizer())
    prompt = env.sample_prompts(1)[0]
    traj = Trajectory(prompt_ids=prompt, response_ids=[49, 10, EOS], rollout_logp=[0.0] * 3)
    env.score([traj])
    # env.reward_model_sharding=replicate: whole on each rank, the same scores
    whole = make_env(EnvConfig(name="arithmetic", reward_model_path=path,
                               reward_model_sharding="replicate"), build_tokenizer())
    rep = whole.reward_model
    return dict(
        scores=scores.tolist(), one=one.tolist(),
        sharded=all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in params),
        read_fraction=rm.load_stats.elements_read / rm.load_stats.elements_total,
        env_reward=traj.reward, env_ids=prompt + [49, 10, EOS],
        replicated=dict(scores=rep.score(seqs).tolist(),
                        plain=not any(isinstance(p, DTensor) for p in rep.module.parameters()),
                        read_fraction=rep.load_stats.elements_read / rep.load_stats.elements_total),
    )


def test_two_ranks_score_like_one_sequence_alone(rm_path, ref):
    outs = run_ranks(_rank_checks, 2, rm_path, SEQS, timeout=120)
    for out in outs:
        torch.testing.assert_close(torch.tensor(out["scores"]), ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(out["one"]), ref[:1], atol=1e-5, rtol=0)
        assert out["sharded"], "score() left the FSDP root unsharded"
        assert out["read_fraction"] < 0.55  # each rank read about half the model
        rep = out["replicated"]  # env.reward_model_sharding=replicate
        torch.testing.assert_close(torch.tensor(rep["scores"]), ref, atol=1e-5, rtol=0)
        assert rep["plain"] and rep["read_fraction"] == 1.0
    assert outs[0]["env_reward"] == outs[1]["env_reward"]
    expected = hf_scores(rm_path, [outs[0]["env_ids"]])[0]
    assert abs(outs[0]["env_reward"] - float(expected)) < 1e-5


def _arith_trajs(tok, env: ArithmeticEnv, n: int) -> list[Trajectory]:
    trajs = []
    for i, prompt in enumerate(env.sample_prompts(n)):
        answer = env.answer_for(tok.decode(prompt)) if i % 2 == 0 else "0"
        response = encode(tok, answer + "\n") + [EOS]
        trajs.append(Trajectory(prompt_ids=prompt, response_ids=response,
                                rollout_logp=[0.0] * len(response)))
    return trajs


def test_env_reward_is_rm_score_and_task_reward_goes_to_info(rm_path):
    tok = build_tokenizer()
    base = ArithmeticEnv(tok, seed=5)
    env = RewardModelEnv(base, RewardModel(rm_path), tok)
    assert env.same_tokens  # same byte-level vocabulary: ids pass through
    trajs = _arith_trajs(tok, base, 4)
    env.score(trajs)
    expected = hf_scores(rm_path, [t.prompt_ids + t.response_ids for t in trajs])
    for i, (t, s) in enumerate(zip(trajs, expected.tolist())):
        assert t.reward_components == {"rm": pytest.approx(s, abs=1e-5)}
        assert t.reward == math.fsum(t.reward_components.values())  # reward = sum still holds
        task = t.info["task_reward_components"]
        assert set(task) == {"correct", "format"} and t.info["correct"] == task["correct"]
        assert t.info["task_reward"] == pytest.approx(sum(task.values()))
        if i % 2 == 0:  # the reference answer: the task's exact match still says so
            assert t.info["correct"] == 1.0 and t.info["task_reward"] == pytest.approx(1.1)


class _StubRM:
    """Duck-typed reward model: returns fixed scores; records the ids it got."""

    def __init__(self, scores: list[float], tokenizer=None) -> None:
        self.scores, self.tokenizer, self.seen = scores, tokenizer, None

    def score(self, seqs):
        self.seen = [list(s) for s in seqs]
        return torch.tensor(self.scores[: len(seqs)])


def test_non_finite_score_is_a_reward_error_naming_the_sample():
    tok = build_tokenizer()
    base = ArithmeticEnv(tok, seed=1)
    trajs = _arith_trajs(tok, base, 3)
    env = RewardModelEnv(base, _StubRM([0.5, float("nan"), 1.0]), tok, task_metrics=False)
    with pytest.raises(RewardError, match="reward model score nan is not finite") as info:
        env.score(trajs)
    assert repr(tok.decode(trajs[1].prompt_ids)) in str(info.value)
    assert all(t.reward == 0.0 and not t.reward_components for t in trajs)  # untouched
    env = RewardModelEnv(base, _StubRM([float("inf")]), tok, task_metrics=False)
    with pytest.raises(RewardError, match="inf"):
        env.score(trajs[:1])


def test_other_tokenizer_rescoring_uses_text():
    class ByteTok:  # a "different" tokenizer: one id per byte, plus a BOS 300
        def get_vocab(self):
            return {"x": 0}

        def __call__(self, text):
            return {"input_ids": [300] + list(text.encode())}

    tok = build_tokenizer()
    base = ArithmeticEnv(tok, seed=2)
    stub = _StubRM([1.0], tokenizer=ByteTok())
    env = RewardModelEnv(base, stub, tok, task_metrics=False)
    assert not env.same_tokens
    traj = _arith_trajs(tok, base, 1)[0]
    env.score([traj])
    text = tok.decode(traj.prompt_ids) + tok.decode(traj.response_ids, skip_special_tokens=True)
    assert stub.seen == [[300] + list(text.encode())]


def test_another_tokenizer_with_a_chat_template_scores_the_conversation():
    """The reward model's own template over the prompt's messages as the policy saw
    them (its system prompt too), then the response as the assistant's turn."""
    from hybrid_engine.envs.chat import PromptFormat

    class ChatTok:
        chat_template = "stub"

        def __init__(self):
            self.seen = []

        def get_vocab(self):
            return {"x": 0}

        def apply_chat_template(self, msgs, tokenize):
            self.seen.append(msgs)
            return [7] * len(msgs)

    tok, rm_tok = build_tokenizer(), ChatTok()
    base = ArithmeticEnv(tok, seed=2, prompt_format=PromptFormat("none"))
    base.prompt_format = PromptFormat("none", system_prompt="Add.")  # as the policy saw it
    stub = _StubRM([1.0], tokenizer=rm_tok)
    env = RewardModelEnv(base, stub, tok, task_metrics=False)
    traj = _arith_trajs(tok, base, 1)[0]
    env.score([traj])
    prompt = tok.decode(traj.prompt_ids)
    assert rm_tok.seen == [[{"role": "system", "content": "Add."},
                            {"role": "user", "content": prompt},
                            {"role": "assistant",
                             "content": tok.decode(traj.response_ids, skip_special_tokens=True)}]]
    assert stub.seen == [[7, 7, 7]]


def test_make_env_wraps_the_named_env(rm_path):
    tok = build_tokenizer()
    env = make_env(EnvConfig(name="arithmetic", seed=4, reward_model_path=rm_path), tok)
    plain = make_env(EnvConfig(name="arithmetic", seed=4), tok)
    assert isinstance(env, RewardModelEnv) and isinstance(env.base_env, ArithmeticEnv)
    assert isinstance(env, Environment) and not isinstance(plain, RewardModelEnv)
    assert env.sample_prompts(3) == plain.sample_prompts(3)
    assert env.eval_prompts(2) == plain.eval_prompts(2)
    assert env.state_dict() == plain.state_dict()
    assert env.answer_for("1+2=") == "3"  # other attributes delegate to the task


def test_a_reward_model_term_is_weighted_beside_the_task_and_a_function(rm_path):
    """env.rewards=reward_model:0.5,task: the sum of both, each part logged, and the
    env scores in the training layout (a model forward)."""
    from hybrid_engine.roles.base import layout_of

    tok = build_tokenizer()
    env = make_env(EnvConfig(name="arithmetic", seed=5, reward_model_path=rm_path,
                             rewards="reward_model:0.5,task", reward_workers=0,
                             reward_timeout_s=0), tok)
    assert layout_of(env) == "training"
    trajs = _arith_trajs(tok, env.base_env, 4)
    env.score(trajs)
    expected = hf_scores(rm_path, [t.prompt_ids + t.response_ids for t in trajs]).tolist()
    for i, (t, s) in enumerate(zip(trajs, expected)):
        c = t.reward_components
        assert set(c) == {"reward_model", "correct", "format"}
        assert c["reward_model"] == pytest.approx(s, abs=1e-5)
        assert c["correct"] == (1.0 if i % 2 == 0 else 0.0)
        assert t.reward == pytest.approx(0.5 * s + c["correct"] + c["format"], abs=1e-5)
    assert layout_of(make_env(EnvConfig(name="arithmetic", rewards="task"), tok)) is None


def test_reward_model_needs_one_label(tmp_path):
    path = write_tiny_reward_model(tmp_path / "rm2")
    cfg = json.loads((path / "config.json").read_text())
    cfg["id2label"] = {"0": "a", "1": "b"}
    cfg["label2id"] = {"a": 0, "b": 1}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_labels=1"):
        RewardModel(str(path))
