"""A hand-written REINFORCE loop with HybridActor as the actor backend.

    torchrun --nproc_per_node=2 examples/custom_loop.py MODEL_DIR --out runs/custom
    accelerate launch --cpu --num_processes 2 examples/custom_loop.py MODEL_DIR

Generation (vLLM), the training step (FSDP2) and the weight sync happen in the
actor; the reward, the baseline and the loss are this script's own.
"""
import argparse
import json

from hybrid_engine.policy.colocated import HybridActor, completions_to_trajectories
from hybrid_engine.envs.arithmetic import ArithmeticEnv


def reinforce_loss(inputs, normalizer):
    """-A * log p(token), summed over response tokens / the step's token count."""
    mask = inputs.mask_BT.float()
    loss = -(inputs.advantages_BT * inputs.logp_BT * mask).sum() / normalizer
    return loss, {"loss": loss.detach(), "num_tokens": mask.sum()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="HF model folder")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tp", type=int, default=1, help="vLLM tensor-parallel size")
    p.add_argument("--out", default="runs/custom_loop", help="where the trained policy goes")
    args = p.parse_args()
    actor = HybridActor.from_pretrained(args.model, overrides={
        "rollout.tensor_parallel_size": args.tp, "rollout.max_tokens": 8, "rollout.max_model_len": 64,
        "memory.kv_cache_gib": 0.25, "rollout.enforce_eager": True, "train.lr": 1e-3,
        "model.compute_dtype": "float32", "model.rollout_dtype": "float32"})
    env = ArithmeticEnv(actor.tokenizer, seed=0)
    for step in range(args.steps):
        out = actor.generate(env.sample_prompts(4), num_samples=4, seed=step)
        trajs = completions_to_trajectories(out)
        env.score(trajs)  # exact match + format; then our own shaping: digits in the answer
        rewards = [t.reward + sum(chr(c).isdigit() for c in t.response_ids if c < 128) / 8
                   for t in trajs]
        baseline = sum(rewards) / len(rewards)
        for t, r in zip(trajs, rewards):
            t.advantages = [r - baseline] * len(t.response_ids)
        metrics = actor.train_step(trajs, reinforce_loss)
        actor.sync_weights()
        if actor.rank == 0:
            print(json.dumps({"step": step, "reward": baseline, "loss": metrics["loss"],
                              "grad_norm": metrics["grad_norm"]}), flush=True)
    actor.export_hf(args.out)
    actor.shutdown()


if __name__ == "__main__":
    main()
