"""A real task end to end: `hybrid-engine train` on 2 ranks on a GSM8K-shaped parquet
(question; an answer text ending in '#### N') with a separate eval file, the tiny
model's chat template, and env.rewards = math + format + two user functions: one
that records every call, one that hangs once. Checks: per-component reward
metrics; every sample scored exactly once over the two ranks (by both ranks'
workers); the prompts are the chat template's; no eval-file prompt is trained
on; the hung call was killed at its timeout, counted, and the step went on; no
reward worker outlives the job. A MATH-shaped jsonl through the same
environment and reward: in-process."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from hybrid_engine.testing import run_job

STEPS, PROMPTS, K = 2, 4, 4

_REWARDS = """
import os, time

def record(prompt, completion, answer, solution):
    with open(os.environ["HE_TEST_LOG"], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "rank": os.environ["RANK"], "prompt": prompt,
                            "gold": solution}) + "\\n")
    return 0.0

def hangs_once(prompt, completion, answer):
    try:
        os.close(os.open(os.environ["HE_TEST_LOG"] + ".hung", os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return 0.0
    time.sleep(3600)

import json
"""


def _gsm8k(path: Path, first: int, n: int) -> list[str]:
    import pandas as pd

    qs = [f"Tom has {i} apples and buys {i + 3} more. How many apples does he have?"
          for i in range(first, first + n)]
    answers = [f"He has {i} + {i + 3} = <<{i}+{i + 3}={2 * i + 3}>>{2 * i + 3}.\n#### {2 * i + 3}"
               for i in range(first, first + n)]
    pd.DataFrame({"question": qs, "answer": answers}).to_parquet(path)
    return qs


@pytest.mark.vllm
@pytest.mark.slow
def test_gsm8k_parquet_with_a_chat_template_and_composed_rewards(model_dir, tmp_path) -> None:
    from transformers import AutoTokenizer

    train_qs = _gsm8k(tmp_path / "train.parquet", 0, 40)
    eval_qs = _gsm8k(tmp_path / "test.parquet", 100, 8)
    (tmp_path / "rw.py").write_text(_REWARDS)
    log, out = tmp_path / "calls.jsonl", tmp_path / "run"
    rw = tmp_path / "rw.py"
    proc = run_job(
        ["train", "--recipe=tiny_grpo_debug", "--no-progress",
         f"--model.path={model_dir}", f"--output_dir={out}", "--sync.verify=false",
         f"--env.dataset_path={tmp_path / 'train.parquet'}",
         f"--env.eval_dataset_path={tmp_path / 'test.parquet'}",
         "--env.preprocess=hybrid_engine.envs.preprocess:gsm8k", "--env.chat_template=auto",
         "--env.system_prompt=Answer after ####.",
         f"--env.rewards=math:1.0,format:0.1,{rw}:record:0,{rw}:hangs_once:0",
         "--env.reward_timeout_s=3", "--env.reward_on_timeout=0", 
         f"--train.num_steps={STEPS}", f"--train.prompts_per_step={PROMPTS}",
         f"--rollout.num_samples_per_prompt={K}", "--rollout.max_tokens=8", "--checkpoint_every=0"],
        2, env={"HE_TEST_LOG": str(log)}, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    for key in ("reward/math", "reward/format", "reward/record", "reward/hangs_once",
                "reward/timeouts"):
        assert all(key in r for r in rows), (key, rows[0].keys())
    assert sum(r["reward/timeouts"] for r in rows) == 1.0  # killed once, and the run went on
    calls = [json.loads(ln) for ln in log.read_text().splitlines()]
    assert len(calls) == STEPS * PROMPTS * K  # each sample once, not once per rank
    assert {c["rank"] for c in calls} == {"0", "1"}  # each rank's workers scored a share
    assert not [p for p in {c["pid"] for c in calls} if psutil.pid_exists(p)]
    tok = AutoTokenizer.from_pretrained(model_dir)
    templated = {tok.decode(tok.apply_chat_template(
        [{"role": "system", "content": "Answer after ####."}, {"role": "user", "content": q}],
        add_generation_prompt=True, tokenize=True, return_dict=False), skip_special_tokens=True): q
        for q in train_qs + eval_qs}
    seen = [templated[c["prompt"]] for c in calls]  # KeyError: a prompt not templated so
    assert not set(seen) & set(eval_qs)  # no eval-file prompt was trained on
    assert all(c["gold"].endswith(f"#### {2 * int(q.split()[2]) + 3}")
               for c, q in zip(calls, seen))  # the row's columns reached the function


def test_a_math_jsonl_through_the_same_environment_and_reward(tmp_path) -> None:
    from transformers import AutoTokenizer

    from hybrid_engine.config import EnvConfig
    from hybrid_engine.envs import make_env
    from hybrid_engine.models.tokenizer import write_tokenizer_files
    from hybrid_engine.trajectory import Trajectory

    write_tokenizer_files(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    rows = [{"problem": f"Simplify $\\frac{{{i}}}{{{2 * i}}}$.",
             "solution": f"Divide: $\\frac{{{i}}}{{{2 * i}}} = \\boxed{{\\frac{{1}}{{2}}}}$."}
            for i in range(1, 9)]
    (tmp_path / "math.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = str(tmp_path / "math.jsonl")
    env = make_env(EnvConfig(dataset_path=data, eval_dataset_path=data,
                             preprocess="hybrid_engine.envs.preprocess:math", rewards="math",
                             reward_workers=0, reward_timeout_s=0), tok)
    trajs = []
    for prompt, text in zip(env.eval_prompts(3), ["\\boxed{0.5}", "\\boxed{\\frac{2}{4}}", "1/3"]):
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        trajs.append(Trajectory(prompt_ids=prompt, response_ids=ids, rollout_logp=[0.0] * len(ids)))
    env.score(trajs)
    assert [t.reward for t in trajs] == [1.0, 1.0, 0.0]


@pytest.mark.parametrize("recipe", ["gsm8k_grpo", "math_grpo"])
def test_the_task_recipes_read_the_public_files_layout(recipe, model_dir, tmp_path,
                                                       monkeypatch) -> None:
    """gsm8k_grpo and math_grpo on files shaped and placed like the public ones: the
    preflight's dataset, template and reward checks pass, and the prompts carry the
    recipe's system prompt through the model's chat template."""
    import pandas as pd

    from hybrid_engine.config.recipes import get_recipe
    from hybrid_engine.envs import make_env, reward_terms
    from hybrid_engine.preflight import check_dataset, check_prompts

    monkeypatch.chdir(tmp_path)
    if recipe == "gsm8k_grpo":
        folder = tmp_path / "data/gsm8k/main"
        folder.mkdir(parents=True)
        for split in ("train", "test"):
            _gsm8k(folder / f"{split}-00000-of-00001.parquet", 0 if split == "train" else 50, 20)
    else:
        folder = tmp_path / "data/math/data"
        folder.mkdir(parents=True)
        for split in ("train", "test"):
            pd.DataFrame({"problem": [f"What is ${i}/2$?" for i in range(20)],
                          "solution": [f"It is $\\boxed{{\\frac{{{i}}}{{2}}}}$." for i in range(20)],
                          "level": ["Level 1"] * 20, "type": ["Algebra"] * 20}).to_parquet(
                folder / f"{split}-00000-of-00001.parquet")
    cfg = get_recipe(recipe).env
    check_prompts(cfg, Path(model_dir), check_dataset(cfg))
    assert [t.name for t in reward_terms(cfg)] == ["math", "format"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    env = make_env(cfg, tok)
    text = tok.decode(env.sample_prompts(1)[0], skip_special_tokens=True)
    assert text.startswith(f"system\n{cfg.system_prompt}\nuser\n") and text.endswith("assistant\n")
    env.close()
