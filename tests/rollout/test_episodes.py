"""The rollout loop (`hybrid_engine.rollout.episodes.collect`): loop logic on a scripted
rollout, then end to end on real vLLM (in a fresh process)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pytest

from hybrid_engine.config import MemoryConfig, RolloutConfig
from hybrid_engine.envs.arithmetic import ArithmeticEnv
from hybrid_engine.envs.base import decode, encode
from hybrid_engine.envs.tool import CalcEnv
from hybrid_engine.rollout.agent_loop import ScheduleStats
from hybrid_engine.rollout.episodes import TOOL_CALL_STOP, MultiTurnEnvironment, collect, turn_seed
from hybrid_engine.models.tokenizer import EOS_TOKEN_ID, build_tokenizer
from hybrid_engine.rollout.engine import Completions
from hybrid_engine.trajectory import collate_trajectories

VLLM = [pytest.mark.vllm, pytest.mark.slow]
TOK = build_tokenizer()
PROMPT = "Compute 2*3+4. You may call <calc>EXPR</calc>. Answer with the integer.\n"


def ids(text: str) -> list[int]:
    return encode(TOK, text)


# --- loop logic on a scripted rollout ----------------------------------------


@dataclass
class ScriptedRollout:
    """Stands in for VLLMRollout: `policy(context, sample) -> text` decides each
    completion; the text is cut at the first stop string (kept, as vLLM does
    in token_ids) and at the call's max_tokens. Records every call."""

    policy: Callable[[str, int], str]
    cfg: RolloutConfig = field(default_factory=lambda: RolloutConfig(max_model_len=256,
                                                                     max_tokens=32))
    calls: list[dict] = field(default_factory=list)

    def generate(self, prompts, *, num_samples=None, seed=0, stop=None, include_stop_str=False,
                 max_tokens=None, keys=None) -> Completions:
        k = num_samples or self.cfg.num_samples_per_prompt
        if isinstance(max_tokens, list):
            limits = max_tokens
        else:
            limits = [max_tokens or self.cfg.max_tokens] * len(prompts)
        self.calls.append({"prompts": [list(p) for p in prompts], "k": k, "seed": seed,
                           "stop": list(stop or []), "include": include_stop_str,
                           "max_tokens": list(limits)})
        tokens, logps = [], []
        for p, limit in zip(prompts, limits, strict=True):
            assert len(p) + limit <= self.cfg.max_model_len
            for j in range(k):
                text = self.policy(decode(TOK, p), j)
                cut = [text.find(s) + len(s) for s in (stop or []) if s in text]
                out = ids(text[: min(cut)] if cut else text)
                if text.endswith("<EOS>") and not cut:
                    out = ids(text[: -len("<EOS>")]) + [EOS_TOKEN_ID]
                out = out[:limit]
                tokens.append(out)
                logps.append([-(len(p) + t) / 1000 for t in range(len(out))])  # distinct values
        return Completions([list(p) for p in prompts], tokens, logps, k)


def calc_then_answer(context: str, sample: int) -> str:
    """Sample 0 calls the calculator once then answers from the result; sample 1
    answers directly (wrongly)."""
    if sample == 1 and "<result>" not in context:
        return "11<EOS>"
    if "<result>" not in context:
        return "Let me see <calc>2*3+4</calc> and more text never sampled"
    return context.rsplit("<result>", 1)[1].split("</result>", 1)[0] + "\n<EOS>"


def env_columns(traj) -> list[int]:
    """Response-local positions of env tokens."""
    return [j for j, m in enumerate(traj.loss_mask) if not m]


def test_tool_tokens_are_context_but_not_loss():
    env = CalcEnv(TOK)
    rollout = ScriptedRollout(calc_then_answer)
    trajs = collect(rollout, env, [ids(PROMPT)], num_samples=2, seed=7)
    assert [t.group_id for t in trajs] == [0, 0]
    called, direct = trajs
    reply = ids("<result>10</result>")
    policy_1 = ids("Let me see <calc>2*3+4</calc>")
    assert called.response_ids == policy_1 + reply + ids("10\n") + [EOS_TOKEN_ID]
    assert called.info["num_tool_calls"] == 1 and called.info["num_segments"] == 2
    assert direct.response_ids == ids("11") + [EOS_TOKEN_ID]
    assert direct.info["num_tool_calls"] == 0 and direct.info["num_turns"] == 1
    # The second generation was conditioned on the env reply (it is in the context).
    assert len(rollout.calls) == 2
    assert rollout.calls[1]["prompts"] == [ids(PROMPT) + policy_1 + reply]
    # After collation: env columns are in tokens_BT but out of the loss mask.
    batch = collate_trajectories(trajs, pad_id=EOS_TOKEN_ID)
    row = batch.order_B.tolist().index(0)
    p, s = int(batch.prompt_lens_B[row]), int(batch.seq_lens_B[row])
    env_cols = {p + j for j in env_columns(called)}
    assert len(env_cols) == len(reply)
    assert batch.tokens_BT[row, sorted(env_cols)].tolist() == reply
    mask = batch.loss_mask_BT[row].tolist()
    assert [c for c in range(len(mask)) if mask[c]] == [c for c in range(p, s) if c not in env_cols]
    assert batch.rollout_logp_BT[row, sorted(env_cols)].abs().sum() == 0
    # The sampling log-probs of the policy tokens are those the rollout reported.
    assert all(lp < 0 for lp, m in zip(called.rollout_logp, called.loss_mask) if m)
    env.score(trajs)
    assert [t.reward for t in trajs] == [1.0, 0.0]


def test_calls_are_per_turn_and_stop_at_the_tool_tag():
    rollout = ScriptedRollout(calc_then_answer, RolloutConfig(max_model_len=256, max_tokens=32,
                                                              stop=("\n\n",)))
    collect(rollout, CalcEnv(TOK), [ids(PROMPT), ids(PROMPT.replace("2*3", "5*3"))],
            num_samples=2, seed=7)
    first, second = rollout.calls
    assert (first["k"], first["seed"], len(first["prompts"])) == (2, 7, 2)
    assert (second["k"], second["seed"], len(second["prompts"])) == (1, turn_seed(7, 1), 2)
    for call in rollout.calls:
        assert call["include"] and set(call["stop"]) == {"\n\n", *TOOL_CALL_STOP}
    # Turn 1 continues only the running episodes (sample 0 of each prompt), with
    # the room left in the context.
    assert second["max_tokens"] == [min(32, 256 - len(c)) for c in second["prompts"]]
    assert turn_seed(7, 1) != turn_seed(7, 2) != turn_seed(8, 1)


def test_context_budget_ends_episodes():
    def always_call(context: str, sample: int) -> str:
        return "<calc>1+1</calc>"

    call, reply = ids("<calc>1+1</calc>"), ids("<result>2</result>")
    assert (len(call), len(reply)) == (16, 18)
    prompt = ids(PROMPT)
    # Room for two calls; the second reply overflows, so no third generation.
    max_len = len(prompt) + 60
    rollout = ScriptedRollout(always_call, RolloutConfig(max_model_len=max_len, max_tokens=16))
    (traj,) = collect(rollout, CalcEnv(TOK, max_turns=100), [prompt], num_samples=1, seed=0)
    assert len(rollout.calls) == 2 and rollout.calls[1]["max_tokens"] == [16]
    assert traj.info["context_full"] and traj.info["num_turns"] == 2
    assert traj.response_ids == (call + reply) * 2  # only the last env reply passes max_len
    assert traj.num_tokens == max_len + 8
    # Less room than max_tokens: the segment is cut there, which ends the episode.
    max_len = len(prompt) + 40
    rollout = ScriptedRollout(always_call, RolloutConfig(max_model_len=max_len, max_tokens=16))
    (traj,) = collect(rollout, CalcEnv(TOK, max_turns=100), [prompt], num_samples=1, seed=0)
    assert rollout.calls[1]["max_tokens"] == [40 - 34]
    assert traj.response_ids == call + reply + call[:6] and traj.num_tokens == max_len
    assert not traj.info["context_full"] and traj.info["num_turns"] == 1


def test_max_turns_and_determinism():
    def always_call(context: str, sample: int) -> str:
        return f"<calc>{sample}+{context.count('<result>')}</calc>"

    env = CalcEnv(TOK, max_turns=3)
    a = collect(ScriptedRollout(always_call), env, [ids(PROMPT)], num_samples=2, seed=1)
    b = collect(ScriptedRollout(always_call), env, [ids(PROMPT)], num_samples=2, seed=1)
    assert [t.info["num_turns"] for t in a] == [3, 3]  # two calls answered, the third not
    assert [(t.response_ids, t.loss_mask, t.rollout_logp) for t in a] == \
        [(t.response_ids, t.loss_mask, t.rollout_logp) for t in b]
    # (the scripted sample index is the one within each call: 0 after turn 0)
    assert decode(TOK, a[1].response_ids) == ("<calc>1+0</calc><result>1</result>"
                                              "<calc>0+1</calc><result>1</result>"
                                              "<calc>0+2</calc>")


def test_single_turn_env_is_one_call():
    env = ArithmeticEnv(TOK)
    assert not isinstance(env, MultiTurnEnvironment) and isinstance(CalcEnv(TOK),
                                                                    MultiTurnEnvironment)
    rollout = ScriptedRollout(lambda context, j: f"{j}\n<EOS>")
    prompts = [ids("1+2="), ids("3+4=")]
    trajs = collect(rollout, env, prompts, num_samples=3, seed=5)
    assert len(rollout.calls) == 1 and rollout.calls[0]["k"] == 3
    assert rollout.calls[0]["stop"] == [] and not rollout.calls[0]["include"]
    assert [t.group_id for t in trajs] == [0, 0, 0, 1, 1, 1]
    assert [t.prompt_ids for t in trajs] == [prompts[0]] * 3 + [prompts[1]] * 3
    assert all(all(t.loss_mask) and t.info["num_turns"] == 0 for t in trajs)
    assert collect(rollout, env, [], num_samples=3, seed=5) == []
    with pytest.raises(ValueError, match="num_samples"):
        collect(rollout, env, prompts, num_samples=0, seed=5)


class DroppingToolEnv(CalcEnv):
    """Breaks the protocol: its trajectories leave out the env replies."""

    def build_trajectory(self, state, policy_logp=None, group_id=0):
        traj = super().build_trajectory(state, policy_logp, group_id)
        keep = [j for j, m in enumerate(traj.loss_mask) if m]
        traj.response_ids = [traj.response_ids[j] for j in keep]
        traj.rollout_logp = [traj.rollout_logp[j] for j in keep]
        traj.loss_mask = [True] * len(keep)
        return traj


def test_env_breaking_the_protocol_is_an_error():
    with pytest.raises(RuntimeError, match="differ from the context"):
        collect(ScriptedRollout(calc_then_answer), DroppingToolEnv(TOK), [ids(PROMPT)],
                num_samples=1, seed=0)


# --- end to end on real vLLM ---------------------------------------------------

# Digits and lowercase letters end a turn: 36 of the model's 259 ids, so with
# 8 new tokens per turn a segment ends in a "call" about 70% of the time.
STOP_CHARS = tuple("0123456789abcdefghijklmnopqrstuvwxyz")


def _any_char_calls(text: str):
    """A turn ending in one of STOP_CHARS asks the calculator for its length."""
    from hybrid_engine.tools.parsers import ParsedTurn, ToolCall

    if text and text[-1] in STOP_CHARS:
        return ParsedTurn("", (ToolCall("calculator", {"expression": str(len(text))}),), ())
    return ParsedTurn(text, (), ())


class AnyCharToolEnv(CalcEnv):
    """CalcEnv whose "tool call" is a turn ending in a digit or lowercase letter
    (what a random-init model does emit): it gets a `<result>...</result>` reply
    like a calculator call. Everything else (episode end, trajectory) is CalcEnv's."""

    def __init__(self, tokenizer, **kwargs) -> None:
        from hybrid_engine.tools.parsers import ToolParser

        super().__init__(tokenizer, **kwargs)
        self.prompt_format = replace(self.prompt_format, turn_stop=STOP_CHARS)
        self.turn_stop = STOP_CHARS
        self.parser = ToolParser("any_char", STOP_CHARS, _any_char_calls)


class Recorder:
    """Forwards to a VLLMRollout and records each call's prompts."""

    def __init__(self, rollout) -> None:
        self.rollout, self.cfg, self.prompts = rollout, rollout.cfg, []

    def generate(self, prompts, **kwargs):
        self.prompts.append([list(p) for p in prompts])
        return self.rollout.generate(prompts, **kwargs)


def _plain(trajs) -> list[tuple]:
    return [(t.prompt_ids, t.response_ids, [float(x) for x in t.rollout_logp], t.loss_mask,
             t.group_id, {**t.info, **({} if t.token_versions is None
                                       else {"token_versions": t.token_versions})})
            for t in trajs]


def _rollout(model_dir: str, tp: int = 1):
    from hybrid_engine.rollout.engine import VLLMRollout

    cfg = RolloutConfig(max_model_len=128, max_tokens=8, enforce_eager=True, seed=2,
                        temperature=1.0, tensor_parallel_size=tp)
    return VLLMRollout(model_dir, cfg, memory=MemoryConfig(kv_cache_gib=0.25), dtype="float32")


def _vllm_episodes(model_dir: str) -> dict:
    rollout = _rollout(model_dir)
    cfg = rollout.cfg
    out: dict = {}
    # What vLLM does with stop strings: stop on two ASCII bytes sampled after
    # the start (same seed, same draws), with and without include_stop_str.
    from vllm import SamplingParams, TokensPrompt

    prompt = [ids("12+35=")]
    base = rollout.generate(prompt, num_samples=1, seed=5, max_tokens=16)
    toks = base.token_ids[0]
    at = next(i for i in range(2, 15) if toks[i] < 128 and toks[i + 1] < 128)
    stop = bytes(toks[at : at + 2]).decode()
    out["stop"] = {"base": toks, "base_logp": base.logprobs[0], "stop": stop}
    for include in (False, True):
        c = rollout.generate(prompt, num_samples=1, seed=5, max_tokens=16, stop=[stop],
                             include_stop_str=include)
        text = rollout.llm.generate(
            [TokensPrompt(prompt_token_ids=prompt[0])],
            SamplingParams(max_tokens=16, seed=hash((cfg.seed, 5, 0, 0)) & 0x7FFFFFFF,  # same draws
                           stop=[stop], include_stop_str_in_output=include),
            use_tqdm=False)[0].outputs[0]
        out["stop"][include] = (c.token_ids[0], c.logprobs[0])
        out["stop"][f"text_{include}"] = (text.text, list(text.token_ids), text.finish_reason,
                                          text.stop_reason)
    # Per-prompt max_tokens, and the prompt-length check that follows it.
    c = rollout.generate([ids("1+1="), ids("2+2=")], num_samples=1, seed=1, max_tokens=[3, 5])
    out["per_prompt_lens"] = [len(t) for t in c.token_ids]
    try:
        rollout.generate([[65] * 120], num_samples=1, max_tokens=9)
        out["long_prompt"] = "accepted"
    except ValueError as e:
        out["long_prompt"] = str(e)
    out["long_ok"] = len(rollout.generate([[65] * 120], num_samples=1, max_tokens=8).token_ids[0])

    # Single-turn: collect is one generate call.
    arith = ArithmeticEnv(TOK)
    ps = [ids("1+2="), ids("30-4=")]
    trajs = collect(rollout, arith, ps, num_samples=2, seed=3)
    direct = rollout.generate(ps, num_samples=2, seed=3)
    out["single"] = (_plain(trajs), direct.token_ids, direct.logprobs)

    # Multi-turn, the real calculator env (a random model will hardly call it).
    tool = CalcEnv(TOK)
    tool_prompts = tool.sample_prompts(2)
    out["tool_prompts"] = tool_prompts
    out["tool"] = _plain(collect(rollout, tool, tool_prompts, num_samples=3, seed=11))
    out["tool_again"] = _plain(collect(rollout, tool, tool_prompts, num_samples=3, seed=11))
    out["tool_other"] = _plain(collect(rollout, tool, tool_prompts, num_samples=3, seed=12))

    # Multi-turn with turns the random model does take.
    rec = Recorder(rollout)
    anyc = AnyCharToolEnv(TOK, max_turns=8)
    out["any"] = _plain(collect(rec, anyc, tool_prompts, num_samples=3, seed=11))
    out["any_calls"] = rec.prompts
    # The same episodes per episode (the default schedule), then through the turn
    # loop on the engine itself (rollout.schedule=turn).
    per_episode, per_turn = ScheduleStats(), ScheduleStats()
    out["any_again"] = _plain(collect(rollout, anyc, tool_prompts, num_samples=3, seed=11,
                                      stats=per_episode))
    rollout.cfg = replace(cfg, schedule="turn")
    out["any_turn"] = _plain(collect(rollout, anyc, tool_prompts, num_samples=3, seed=11,
                                     stats=per_turn))
    out["engine_steps"] = (per_episode.engine_steps, per_turn.engine_steps)
    out["partial"] = _partial_turns(rollout, anyc, tool_prompts)
    # Log-probs for the first sample of each group only (rollout.mismatch_sample):
    # the others' first turn has none (NaN), and that is no error.
    rollout.cfg, rollout.logprob_samples = cfg, 1
    out["some_logprobs"] = _plain(collect(rollout, anyc, tool_prompts, num_samples=3, seed=11))
    rollout.logprob_samples = None
    rollout.shutdown()
    return out


def _pool(rollout, budget: int):
    from hybrid_engine.config import AsyncConfig
    from hybrid_engine.rollout.partial import PartialRollouts

    return PartialRollouts(rollout.cfg, AsyncConfig(max_staleness=1, partial=True,
                                                    step_token_budget=budget))


def _parked(pool) -> list[tuple[int, int]]:
    """(tokens of the segment in progress, segments done) of each parked episode."""
    return [(s.turns.segment, s.turns.num_segments) for g in pool.pool for s in g.samples
            if not s.finished]


def _partial_turns(rollout, env, prompts) -> dict:
    """Partial rollouts of multi-turn episodes (rollout/partial_turns.py): with a
    budget no call reaches, and with one that parks episodes mid-turn; the tight
    pool continued as it is in memory and as reloaded from its JSON."""
    import json

    out = {"roomy": _plain(_pool(rollout, 10**6).collect(rollout, prompts, num_samples=3,
                                                         seed=11, version=0, env=env))}
    for budget in range(20, 100, 10):  # a budget that stops a round mid-segment
        kept = _pool(rollout, budget)
        first = kept.collect(rollout, prompts, num_samples=3, seed=11, version=0, env=env)
        if any(segment > 0 for segment, _ in _parked(kept)):
            break
    out["first"], out["parked"] = _plain(first), _parked(kept)
    out["parked_tokens"] = {tuple(g.prompt_ids + s.tokens): list(s.turns.mask) for g in kept.pool
                            for s in g.samples if s.tokens}
    reloaded = _pool(rollout, budget)
    reloaded.load_state_dict(json.loads(json.dumps(kept.state_dict())))
    out["second"] = _plain(kept.collect(rollout, prompts, num_samples=3, seed=12, version=1,
                                        env=env))
    out["second_reloaded"] = _plain(reloaded.collect(rollout, prompts, num_samples=3, seed=12,
                                                     version=1, env=env))
    out["metrics"] = kept.metrics()
    return out


class FailingToolEnv(AnyCharToolEnv):
    """Raises on the third step it takes (on the rank that runs the env)."""

    def step(self, state, new_policy_tokens):
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps == 3:
            raise ValueError("tool exploded")
        return super().step(state, new_policy_tokens)


def _vllm_two_ranks(model_dir: str, tp: int) -> list[tuple]:
    """The multi-turn collect of _vllm_episodes on 2 ranks (2 replicas of TP 1, or
    one of TP 2), per episode."""
    rollout = _rollout(model_dir, tp)
    tool_prompts = CalcEnv(TOK).sample_prompts(2)
    out = _plain(collect(rollout, AnyCharToolEnv(TOK, max_turns=8), tool_prompts,
                         num_samples=3, seed=11))
    try:  # an env error on one rank: every rank raises, none waits for a timeout
        collect(rollout, FailingToolEnv(TOK, max_turns=8), tool_prompts, num_samples=3, seed=11)
        failed = "no error"
    except (ValueError, RuntimeError) as e:
        failed = f"{type(e).__name__}: {e}"
    pool = _pool(rollout, 12)  # partial rollouts: each replica its groups, then gathered
    partial = [_plain(pool.collect(rollout, tool_prompts, num_samples=3, seed=s, version=s,
                                   env=AnyCharToolEnv(TOK, max_turns=8))) for s in (0, 1)]
    rollout.shutdown()
    return out, failed, (partial, pool.state_dict(), pool.metrics())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from dataclasses import replace

    from hybrid_engine.models.tiny import PRESETS, write_tiny_model
    from hybrid_engine.models.tokenizer import TOKENIZER_VOCAB_SIZE

    # Vocabulary = the tokenizer's: every sampled id is a byte or a special token
    # (with the preset's 1000 ids, 3/4 of the draws would decode to nothing).
    spec = replace(PRESETS["tiny"], vocab_size=TOKENIZER_VOCAB_SIZE)
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny"), spec))


@pytest.fixture(scope="module")
def vllm_results(model_dir) -> dict:
    from hybrid_engine.testing import run_in_subprocess

    return run_in_subprocess(_vllm_episodes, model_dir, timeout=400)


def _check_structure(trajs: list[tuple], num_prompts: int, k: int, max_model_len: int) -> None:
    assert [t[4] for t in trajs] == [i // k for i in range(num_prompts * k)]
    for prompt, response, logp, mask, _, info in trajs:
        assert len(response) == len(logp) == len(mask) >= 1
        assert all(lp <= 0 for lp, m in zip(logp, mask) if m)
        assert all(lp == 0 for lp, m in zip(logp, mask) if not m)
        assert info["num_segments"] >= 1 and info["num_turns"] >= 0
        last_policy = max(j for j, m in enumerate(mask) if m)
        assert len(prompt) + last_policy + 1 <= max_model_len  # generation stays within it


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_stop_strings_stay_in_token_ids(vllm_results):
    s = vllm_results["stop"]
    base, stop = s["base"], s["stop"]
    first = next(i for i in range(len(base)) if bytes(base[i : i + 2]).decode(errors="replace")
                 == stop)
    cut = base[: first + 2]
    # include_stop_str_in_output False and True alike: token_ids run through the
    # token that completes the stop string; logprobs match the uncut draw.
    for include in (False, True):
        tokens, logp = s[include]
        assert tokens == cut, include
        assert logp == s["base_logp"][: len(cut)]
    # The flag only changes vLLM's text.
    for include in (False, True):
        text, token_ids, finish, reason = s[f"text_{include}"]
        assert (finish, reason, token_ids) == ("stop", stop, cut)
        assert text.endswith(stop) == include


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_per_prompt_max_tokens(vllm_results):
    assert all(n <= m for n, m in zip(vllm_results["per_prompt_lens"], [3, 5]))
    assert "max_model_len - max_tokens=9 = 119" in vllm_results["long_prompt"]
    assert 1 <= vllm_results["long_ok"] <= 8


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_single_turn_is_one_generate(vllm_results):
    trajs, token_ids, logprobs = vllm_results["single"]
    assert [t[1] for t in trajs] == token_ids and [t[2] for t in trajs] == logprobs
    assert [t[4] for t in trajs] == [0, 0, 1, 1]
    assert all(all(t[3]) for t in trajs)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_tool_env_episodes(vllm_results):
    r = vllm_results
    _check_structure(r["tool"], 2, 3, 128)
    assert [t[0] for t in r["tool"]] == [p for p in r["tool_prompts"] for _ in range(3)]
    assert r["tool"] == r["tool_again"]  # same seed, same trajectories
    assert r["tool"] != r["tool_other"]


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_multi_turn_env_tokens_in_context_not_in_loss(vllm_results):
    from hybrid_engine.trajectory import Trajectory

    r = vllm_results
    trajs = r["any"]
    _check_structure(trajs, 2, 3, 128)
    assert trajs == r["any_turn"]  # rollout.schedule=turn: the turn loop, exactly
    # Per episode (engine steps driven by hand; rollout.schedule=episode): the same
    # tokens from the same per-request seeds, log-probs to float noise (other batches).
    assert r["engine_steps"][0] > 0 and r["engine_steps"][1] == 0
    _assert_same_up_to_logp_noise(r["any_again"], trajs)
    some = r["some_logprobs"]
    assert [t[1] for t in some] == [t[1] for t in trajs]  # the same episodes
    first_turn_nan = [math.isnan(t[2][0]) for t in some]
    assert first_turn_nan == [i % 3 != 0 for i in range(len(some))]
    multi = [t for t in trajs if t[5]["num_tool_calls"] >= 1]
    assert multi, "no episode took a turn: pick another seed"
    assert max(t[5]["num_segments"] for t in trajs) >= 2
    later_contexts = [p for call in r["any_calls"][1:] for p in call]
    result_open = ids("<result>")
    for prompt, response, _, mask, _, info in multi:
        full = prompt + response
        # Each env reply ends a context a later generation was asked to continue
        # (unless the episode ended right there: max_turns or context full).
        ends = [len(prompt) + j + 1 for j in range(len(mask))
                if not mask[j] and (j + 1 == len(mask) or mask[j + 1])]
        continued = [e for e in ends if full[:e] in later_contexts]
        assert len(continued) >= len(ends) - 1
        assert all(full[e - len(ids("</result>")):e] == ids("</result>") for e in ends)
        for e in continued:
            assert result_open[0] in full[len(prompt):e]
    # Collated: env columns are context (tokens_BT) and never loss.
    objs = [Trajectory(prompt_ids=t[0], response_ids=t[1], rollout_logp=t[2], loss_mask=t[3],
                       group_id=t[4]) for t in trajs]
    batch = collate_trajectories(objs, pad_id=EOS_TOKEN_ID)
    for row, i in enumerate(batch.order_B.tolist()):
        prompt, response, _, mask, _, _ = trajs[i]
        p, s = len(prompt), len(prompt) + len(response)
        assert batch.tokens_BT[row, :s].tolist() == prompt + response
        assert batch.loss_mask_BT[row, p:s].tolist() == mask
        assert not batch.loss_mask_BT[row, :p].any() and not batch.loss_mask_BT[row, s:].any()
        env_cols = [p + j for j, m in enumerate(mask) if not m]
        if env_cols:
            assert decode(TOK, batch.tokens_BT[row, env_cols].tolist()).startswith("<result>")


def _without_versions(trajs: list[tuple]) -> list[tuple]:
    return [(*t[:5], {k: v for k, v in t[5].items() if k != "token_versions"}) for t in trajs]


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_multi_turn_partial_rollouts_park_mid_turn_and_resume_exactly(vllm_results):
    r = vllm_results["partial"]
    # Parking nothing, the episodes are the turn loop's (log-probs to float noise: the
    # engine's batches differ, each turn enters as soon as the last one is answered).
    _assert_same_up_to_logp_noise(_without_versions(r["roomy"]), vllm_results["any_turn"])
    assert all(set(t[5]["token_versions"]) == {0} for t in r["roomy"])
    # The tight budget parked episodes, some in the middle of a segment.
    assert r["parked"] and any(segment > 0 for segment, _ in r["parked"]), r["parked"]
    assert len(r["first"]) >= 3 and len(r["first"]) % 3 == 0
    _check_structure(r["second"], len(r["second"]) // 3, 3, 128)
    # Continued next call: the parked tokens (policy and env) kept as they were, the
    # rest sampled at version 1; every trajectory passed the loop's context check.
    continued = [t for t in r["second"] if set(t[5]["token_versions"]) == {0, 1}]
    assert continued and r["metrics"]["partial/continued_samples"] >= len(continued)
    for prompt, response, _, mask, _, info in continued:
        v = info["token_versions"]
        assert v == sorted(v) and len(v) == len(response)
        n0 = v.count(0)
        assert r["parked_tokens"][tuple(prompt + response[:n0])] == mask[:n0]
    # A pool reloaded from its JSON continues exactly as the one kept in memory.
    assert r["second_reloaded"] == r["second"]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_multi_turn_is_collective(model_dir, vllm_results, tp):
    """2 ranks sample per episode: as 2 replicas (each its half of the episodes,
    gathered at the end) or as one TP-2 engine (the first rank runs the env
    and broadcasts each engine step's new requests). They return the same
    trajectories, which are the turn loop's in one process (log-probs equal up
    to float noise: the batches differ)."""
    from hybrid_engine.testing import run_ranks

    outs = run_ranks(_vllm_two_ranks, 2, model_dir, tp, timeout=400)
    assert outs[0][0] == outs[1][0]
    _assert_same_up_to_logp_noise(outs[0][0], vllm_results["any"])
    # Partial rollouts: every rank holds the same pool and returns the same episodes.
    assert outs[0][2] == outs[1][2]
    partial, _, metrics = outs[0][2]
    assert partial[0] and metrics["partial/sampled_tokens"] > 0
    # The env raised on rank 0 (TP 2: the leader; 2 replicas: each raised on its own
    # episodes): rank 0 raised it, rank 1 its own or the news of it.
    assert outs[0][1] == "ValueError: tool exploded"
    assert outs[1][1] in ("ValueError: tool exploded",
                          "RuntimeError: rank 0 failed in the per-episode loop: "
                          "ValueError: tool exploded"), outs[1][1]


def _assert_same_up_to_logp_noise(got: list[tuple], want: list[tuple]) -> None:
    def strip(t: tuple) -> tuple:
        return t[0], t[1], t[3], t[4], t[5]

    assert [strip(t) for t in got] == [strip(t) for t in want]
    for a, b in zip(got, want, strict=True):
        assert max((abs(x - y) for x, y in zip(a[2], b[2], strict=True)), default=0.0) < 1e-5
