"""Checks that vLLM CPU agrees with transformers on tiny model folders.

Run in a fresh process (vLLM changes process state: threads, LD_PRELOAD, env):

    python tests/models/_vllm_check.py FOLDER [FOLDER ...] [--max-tokens 16]

For each folder, one in-process vLLM engine (fp32) samples a completion of a
few prompts with ``temperature=1.0`` and ``logprobs=0``; then transformers
(fp32) scores prompt+completion. Reported per folder: whether vLLM's prompt
ids equal ``AutoTokenizer``'s, and the max |vLLM logprob - transformers
log_softmax| over the sampled tokens. The last stdout line is the JSON result.

Why temperature 1.0: by default (``logprobs_mode="raw_logprobs"``) vLLM
returns the log_softmax of the raw logits, not of the temperature-scaled
sampling distribution; at temperature 1.0 without top-k/top-p both are the
same, so the comparison holds in either logprobs mode.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

PROMPTS = (
    "12+345=357\n",
    "Hello, world!  It's 3:45 pm.\n\tNext line",
    "<|im_start|>user\nWhat is 7*8?<|im_end|>\n<|im_start|>assistant\n",
    "caf\u00e9 na\u00efve \u4e2d\u6587",
)


def run_vllm(folder: str, prompts: list[str], *, seed: int, max_tokens: int) -> list[dict]:
    """Samples ``max_tokens`` tokens per prompt with one fresh vLLM engine.

    Returns:
        Per prompt: ``prompt_ids``, ``output_ids`` and ``logprobs`` (the
        sampled tokens' logprobs).
    """
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=folder,
        dtype="float32",
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=len(prompts),
        seed=seed,
    )
    params = [
        SamplingParams(temperature=1.0, seed=seed + i, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    results = []
    for out in outputs:
        comp = out.outputs[0]
        results.append(
            {
                "prompt_ids": list(out.prompt_token_ids),
                "output_ids": list(comp.token_ids),
                "logprobs": [lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs, strict=True)],
            }
        )
    del llm, outputs
    gc.collect()
    return results


def compare_with_transformers(folder: str, prompts: list[str], samples: list[dict]) -> dict:
    """Compares vLLM's prompt ids and sampled logprobs with transformers fp32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids_equal = True
    max_diff = 0.0
    num_tokens = 0
    for prompt, s in zip(prompts, samples, strict=True):
        ids_equal &= tok(prompt)["input_ids"] == s["prompt_ids"]
        n_p, n_o = len(s["prompt_ids"]), len(s["output_ids"])
        ids_T = torch.tensor([s["prompt_ids"] + s["output_ids"]])
        with torch.no_grad():
            logits_TV = model(ids_T).logits[0].float()
        # Position t predicts token t+1: completion token j is scored at n_p-1+j.
        logp_OV = torch.log_softmax(logits_TV[n_p - 1 : n_p - 1 + n_o], dim=-1)
        ref_O = logp_OV.gather(1, torch.tensor(s["output_ids"])[:, None])[:, 0]
        diff_O = (ref_O - torch.tensor(s["logprobs"])).abs()
        max_diff = max(max_diff, diff_O.max().item())
        num_tokens += n_o
    return {"prompt_ids_equal": bool(ids_equal), "max_abs_diff": max_diff, "num_tokens": num_tokens}


def main(argv: list[str] | None = None) -> dict:
    """Checks each folder; returns ``{folder: result}`` (also printed as JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    prompts = list(PROMPTS)
    results = {}
    samples = {}
    for folder in args.folders:
        t0 = time.perf_counter()
        samples[folder] = run_vllm(folder, prompts, seed=args.seed, max_tokens=args.max_tokens)
        results[folder] = {"vllm_s": round(time.perf_counter() - t0, 2)}
    for folder in args.folders:
        results[folder].update(compare_with_transformers(folder, prompts, samples[folder]))
        results[folder]["output_ids"] = [s["output_ids"] for s in samples[folder]]
    print(json.dumps(results))
    return results


def check_in_fresh_process(folders: list[str], *, timeout: float = 300) -> dict:
    """Runs this script on folders in a fresh interpreter; returns its JSON result."""
    import subprocess

    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run([sys.executable, __file__, *folders], capture_output=True, text=True,
                          timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM check failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main(sys.argv[1:])
