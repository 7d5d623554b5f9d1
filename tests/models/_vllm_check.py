"""Checks that vLLM CPU agrees with transformers on tiny model folders.

Run in a fresh process (vLLM changes process state: threads, LD_PRELOAD, env):

    python tests/models/_vllm_check.py FOLDER [FOLDER ...] [--max-tokens 16]

For each folder, one in-process vLLM engine (fp32) samples a completion of a
few prompts with ``temperature=1.0`` and ``logprobs=0``; then transformers
(fp32) scores prompt+completion. Reported per folder: whether vLLM's prompt
ids equal ``AutoTokenizer``'s, and the max |vLLM logprob - transformers
log_softmax| over the sampled tokens. The last stdout line is the JSON result.

For a Mixture-of-Experts folder each prompt + completion is run once more as
a prompt, with a hook on every router of the vLLM model (its ``gate``), and
``experts_mismatch`` counts the (token, layer) pairs whose top-k experts
differ from those of HF's router logits on the same tokens.

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

    moe = _is_moe(folder)
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
    if moe:
        for r in results:
            r["router_logits"] = _vllm_router_logits(llm, r["prompt_ids"] + r["output_ids"])
    del llm, outputs
    gc.collect()
    return results


def _vllm_router_logits(llm, ids: list[int]) -> list:  # noqa: ANN001
    """Every MoE layer's router logits [len(ids), E] in vLLM's prefill of ids."""
    import torch
    from vllm import SamplingParams

    from hybrid_engine.rollout import vllm_compat

    model = vllm_compat.model(llm)
    captured: list[torch.Tensor] = []
    gates = [m for n, m in model.named_modules() if n.endswith(".gate") and hasattr(m, "weight")]
    hooks = [g.register_forward_hook(lambda _m, _i, out: captured.append(
        (out[0] if isinstance(out, tuple) else out).detach().float().clone())) for g in gates]
    llm.reset_prefix_cache()
    try:
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)
    finally:
        for h in hooks:
            h.remove()
    return [c.tolist() for c in captured[: len(gates)]]


def _is_moe(folder: str) -> bool:
    config = json.loads(open(os.path.join(folder, "config.json")).read())
    return bool(config.get("num_experts") or config.get("num_local_experts"))


def _experts_mismatch(hf_logits: tuple, vllm_logits: list, top_k: int) -> int:
    """(token, layer) pairs whose top-k experts differ between HF's and vLLM's
    router logits (one [tokens, E] per layer each)."""
    import torch

    bad = 0
    for hf, vl in zip(hf_logits, vllm_logits, strict=True):
        a = hf.float().topk(top_k, dim=-1).indices.sort(-1).values
        b = torch.tensor(vl).topk(top_k, dim=-1).indices.sort(-1).values
        bad += int((a != b).any(-1).sum())
    return bad


def compare_with_transformers(folder: str, prompts: list[str], samples: list[dict]) -> dict:
    """Compares vLLM's prompt ids and sampled logprobs with transformers fp32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    # eager: HF's SDPA path leaves out Gemma 2's attention soft-cap
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    ids_equal = True
    max_diff = 0.0
    num_tokens = mismatch = routed = 0
    for prompt, s in zip(prompts, samples, strict=True):
        ids_equal &= tok(prompt)["input_ids"] == s["prompt_ids"]
        n_p, n_o = len(s["prompt_ids"]), len(s["output_ids"])
        ids_T = torch.tensor([s["prompt_ids"] + s["output_ids"]])
        with torch.no_grad():
            out = model(ids_T, output_router_logits="router_logits" in s)
            logits_TV = out.logits[0].float()
        if "router_logits" in s:
            mismatch += _experts_mismatch(out.router_logits, s["router_logits"],
                                          model.config.num_experts_per_tok)
            routed += ids_T.shape[1] * model.config.num_hidden_layers
        # Position t predicts token t+1: completion token j is scored at n_p-1+j.
        logp_OV = torch.log_softmax(logits_TV[n_p - 1 : n_p - 1 + n_o], dim=-1)
        ref_O = logp_OV.gather(1, torch.tensor(s["output_ids"])[:, None])[:, 0]
        diff_O = (ref_O - torch.tensor(s["logprobs"])).abs()
        max_diff = max(max_diff, diff_O.max().item())
        num_tokens += n_o
    return {"prompt_ids_equal": bool(ids_equal), "max_abs_diff": max_diff, "num_tokens": num_tokens,
            "experts_mismatch": mismatch, "experts_routed": routed}


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
