"""Reward from a reward model: a HF sequence-classification model on the same devices.

Job: (1) `RewardModel` loads a `num_labels=1` `AutoModelForSequenceClassification`
checkpoint (Qwen2 / Llama / Qwen3 backbone + `score` Linear) next to the
policy and scores token sequences: the score of a sequence is logit 0 of the
`score` head read at its LAST token; (2) `RewardModelEnv` wraps a task
environment so that this score replaces the task's reward function; (3)
`write_tiny_reward_model` writes a random-init reward-model folder for tests
and demos.

Layout (memory trade-off, env.reward_model_sharding). Under a process group
the reward model uses the trainer's layout by default ("full"): FSDP2
`fully_shard` per decoder layer and at the root over the data-parallel mesh,
every parameter a `Shard(0)` DTensor read row range by row range from the
safetensors (`parallel.params`), so a rank holds 1/N of the model plus, during
a forward, one gathered decoder layer and the root (embeddings, final norm,
score head). The price is one all-gather of the weights per micro-batch (a
larger `micro_batch_size` amortises it). "replicate", a full copy per rank,
needs no all-gather but costs N times the memory: where the reward model has
ranks of its own (placement=grouped) there may be room for it; next to the
policy, the reference and vLLM on a colocated device there rarely is. Every rank holds the whole step's
trajectories (the rollout gathers them): rank r scores its contiguous slice
`shard_rows(n, N, r)` of the sequences, running as many micro-batches as the
busiest rank (dummy one-token forwards past its own last, so FSDP2's
collectives match when sharded), and one all-reduce (a sum over disjoint slices, exact)
gives every rank all n scores. With no process group the model is a plain
single-process module (no mesh, no collective).

Pooling: HF's own `*ForSequenceClassification.forward` reads the rightmost
token that is not `pad_token_id`; with pad == EOS (Qwen-style tokenizers, and
ours) that silently skips a response's trailing EOS. Here the read position
is the sequence's real last token, by length (right padding + attention
mask), so a trailing EOS is scored like any token. Both agree whenever the
sequence contains no pad id; the tests compare with an unpadded HF forward
of each sequence alone.

Invariants: a sequence's score does not depend on the rank count, the
micro-batching or the padding (up to float round-off: the tests check 1e-5);
`RewardModel.score` and `RewardModelEnv.score` are collective under a process
group (every rank calls them with the same sequences, in the same order; the
env's is not when every trajectory already holds its rm_score, the same on
every rank) and leave the FSDP root resharded; a non-finite score is a `RewardError` naming
the sample, raised on every rank (all hold the same scores), before any
trajectory is modified.

Reward invariant of `RewardModelEnv`: `reward_components == {"rm": score}`
and `reward == score` (so "reward is the sum of reward_components" still
holds). The task's own reward, which evaluation accuracy needs, is kept out
of the components (it must not be summed into the reward) and stored for
metrics in `traj.info`: "task_reward" (float), "task_reward_components"
(dict) and, when the task has one, "correct" (float).

Shape legend: B sequences (rows), T token positions, H hidden size.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hybrid_engine.envs.base import RewardError, decode
from hybrid_engine.models.tiny import TinyModelSpec, hf_config, random_state_dict
from hybrid_engine.models.tokenizer import EOS_TOKEN_ID, write_tokenizer_files
from hybrid_engine.parallel.params import reshard_all
from hybrid_engine.reshard.plan import shard_rows

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from hybrid_engine.parallel.placement import Placement
    from hybrid_engine.trajectory import Trajectory

__all__ = ["PlacedRewardModel", "RewardModel", "RewardModelEnv", "RewardModelScorer", "ScoreModel",
           "placed_reward_scorer", "write_tiny_reward_model"]

class ScoreModel(nn.Module):
    """HF backbone + `score` head, returning logit 0 at each row's last real token.

    Parameter names are the sequence-classification checkpoint's ("model.*",
    "score.weight"), so the sharded loader reads them unchanged. One module
    for the whole forward, so FSDP2's root hooks gather the root's
    parameters (embeddings, norm, head) around it.
    """

    def __init__(self, backbone: nn.Module, score: nn.Linear) -> None:
        super().__init__()
        self.model = backbone
        self.score = score

    def forward(self, tokens_BT: Tensor, attention_mask_BT: Tensor, position_ids_BT: Tensor,
                last_B: Tensor) -> Tensor:
        """Returns [B] float32: score(hidden state at column last_B[b]) logit 0."""
        hidden_BTH = self.model(input_ids=tokens_BT, attention_mask=attention_mask_BT,
                                position_ids=position_ids_BT, use_cache=False).last_hidden_state
        rows_B = torch.arange(hidden_BTH.shape[0], device=hidden_BTH.device)
        return self.score(hidden_BTH[rows_B, last_B])[:, 0].float()


def _check_config(config: Any, folder: Path) -> None:
    if getattr(config, "num_labels", None) != 1:
        raise ValueError(
            f"{folder}: a reward model needs num_labels=1 (one score), "
            f"config has num_labels={getattr(config, 'num_labels', None)}"
        )


class RewardModel:
    """A frozen `num_labels=1` sequence-classification model scoring token sequences.

    Collective under a process group: construction and `score` must be
    called by every rank of the mesh (see the module docstring).

    Attributes:
        module: the `ScoreModel` (the FSDP2 root when sharded; plain, whole,
            when replicated or without a mesh).
        mesh: the 1-D data-parallel mesh, or None (single process, plain module).
        config: the transformers config.
        tokenizer: the folder's tokenizer (transformers), or None if it has none.
        micro_batch_size: rows per forward.
        device: where inputs are placed.
    """

    def __init__(
        self,
        path: str,
        mesh: DeviceMesh | None = None,
        *,
        dtype: str = "float32",
        micro_batch_size: int = 16,
        trust_remote_code: bool = False,
        sharding: str = "full",
    ) -> None:
        """Loads the model: sharded over mesh, or whole when there is no process group.

        Args:
            path: HF folder (or hub id) with config.json and safetensors.
            mesh: 1-D data-parallel mesh; None = the whole default group when
                torch.distributed is initialised, else no mesh.
            dtype: parameter and compute dtype, "float32" or "bfloat16"
                (scores are returned in float32).
            micro_batch_size: rows per forward (>= 1).
            trust_remote_code: passed to transformers.
            sharding: its layout over the mesh (env.reward_model_sharding):
                "full" (FSDP2) or "replicate" (whole on every rank); either
                way each rank scores its slice of the rows.

        Raises:
            ValueError: num_labels != 1, an unknown dtype, micro_batch_size < 1,
                or a checkpoint that does not match the config.
        """
        from transformers import AutoConfig

        from hybrid_engine.parallel.fsdp import DTYPES, default_device, dp_mesh, resolve_model_path

        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if sharding not in ("full", "replicate"):
            raise ValueError(f"sharding must be 'full' or 'replicate', got {sharding!r}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
        folder = resolve_model_path(path)
        self.config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
        _check_config(self.config, folder)
        self.micro_batch_size = micro_batch_size
        if mesh is None and dist.is_initialized():
            mesh = dp_mesh()  # every rank scores, whatever the placement
        self.mesh = mesh
        if mesh is None:
            self.device = default_device()
            self.module = self._build_plain(folder, DTYPES[dtype], trust_remote_code)
        else:
            self.device = default_device() if mesh.device_type == "cuda" else torch.device("cpu")
            self.module = self._build_sharded(folder, mesh, DTYPES[dtype], trust_remote_code,
                                              sharding)
        self.module.requires_grad_(False)
        self.module.eval()
        self.tokenizer = _load_tokenizer(folder, trust_remote_code)
        pad = getattr(self.config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0  # any id: the mask hides it
        self.max_len = getattr(self.config, "max_position_embeddings", None)

    def _build_plain(self, folder: Path, dtype: torch.dtype, trust_remote_code: bool) -> ScoreModel:
        from transformers import AutoModelForSequenceClassification

        from hybrid_engine.parallel.fsdp import attn_implementation

        hf = AutoModelForSequenceClassification.from_pretrained(
            folder, dtype=dtype, attn_implementation=attn_implementation(self.config),
            trust_remote_code=trust_remote_code)
        return ScoreModel(getattr(hf, hf.base_model_prefix), hf.score).to(self.device)

    def _build_sharded(self, folder: Path, mesh: DeviceMesh, dtype: torch.dtype,
                       trust_remote_code: bool, sharding: str) -> ScoreModel:
        from transformers import AutoModelForSequenceClassification

        from hybrid_engine.parallel.fsdp import attn_implementation, empty_model, lay_out

        with empty_model():
            hf = AutoModelForSequenceClassification.from_config(
                self.config, dtype=dtype, attn_implementation=attn_implementation(self.config),
                trust_remote_code=trust_remote_code)
        if hf.base_model_prefix != "model" or not hasattr(hf.model, "layers"):
            raise ValueError(f"{folder}: unsupported architecture {type(hf).__name__} "
                             "(needs a decoder backbone at .model.layers)")
        module = ScoreModel(hf.model, hf.score).requires_grad_(False)  # frozen: no DDP
        module, self.load_stats = lay_out(module, folder, mesh, master=dtype, compute=dtype,
                                          sharding=sharding)
        return module

    @property
    def world_size(self) -> int:
        """Ranks sharing the scoring (1 without a mesh)."""
        return 1 if self.mesh is None else self.mesh.size()

    @property
    def rank(self) -> int:
        """This rank's index in the mesh (0 without a mesh)."""
        return 0 if self.mesh is None else self.mesh.get_local_rank()

    @torch.no_grad()
    def score(self, seqs: Sequence[Sequence[int]]) -> Tensor:
        """Scores of whole token sequences (collective under a mesh).

        Args:
            seqs: n non-empty token-id sequences, the same list on every rank.

        Returns:
            float32 [n] on the CPU, in seqs' order, identical on every rank:
            logit 0 of the score head at each sequence's last token.

        Raises:
            ValueError: an empty sequence, or one longer than the model's
                max_position_embeddings (raised on every rank, before any
                collective).
        """
        n = len(seqs)
        for i, s in enumerate(seqs):
            if not s or (self.max_len is not None and len(s) > self.max_len):
                raise ValueError(f"sequence {i} has {len(s)} tokens; the reward model takes "
                                 f"1 to {self.max_len}")
        out_B = torch.zeros(n, dtype=torch.float32)
        if n == 0:
            return out_B
        world, mbs = self.world_size, self.micro_batch_size
        start, end = shard_rows(n, world, self.rank)
        # Longest first: a micro-batch pads to its first row.
        mine = sorted(range(start, end), key=lambda i: -len(seqs[i]))
        # torch.chunk semantics: rank 0 holds the most rows, hence the most micro-batches.
        busiest = -(-(shard_rows(n, world, 0)[1]) // mbs)
        try:
            for k in range(busiest):
                rows = mine[k * mbs:(k + 1) * mbs]
                if rows:
                    out_B[rows] = self._forward([seqs[i] for i in rows]).cpu()
                else:  # keep FSDP2's all-gathers in step with busier ranks
                    self._forward([[self.pad_id]])
        finally:
            if self.mesh is not None:
                reshard_all(self.module)  # a forward without backward leaves the root unsharded
        if self.mesh is not None:
            buf = out_B.to(self.device)
            dist.all_reduce(buf, group=self.mesh.get_group())  # disjoint slices: exact sum
            out_B = buf.cpu()
        return out_B

    def _forward(self, rows: Sequence[Sequence[int]]) -> Tensor:
        """[B] scores of one right-padded micro-batch."""
        lens_B = torch.tensor([len(r) for r in rows], dtype=torch.int64)
        width = int(lens_B.max())
        tokens_BT = torch.full((len(rows), width), self.pad_id, dtype=torch.int64)
        for b, r in enumerate(rows):
            tokens_BT[b, : len(r)] = torch.as_tensor(list(r), dtype=torch.int64)
        mask_BT = torch.arange(width)[None, :] < lens_B[:, None]
        pos_BT = torch.arange(width, dtype=torch.int64).expand(len(rows), width)
        dev = self.device
        return self.module(tokens_BT.to(dev), mask_BT.to(dev), pos_BT.to(dev), (lens_B - 1).to(dev))


def _load_tokenizer(folder: Path, trust_remote_code: bool) -> Any:
    """The folder's transformers tokenizer, or None when it has no tokenizer files."""
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json",
                                                  "vocab.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)


def _vocab(tokenizer: Any) -> dict[str, int] | None:
    get = getattr(tokenizer, "get_vocab", None)
    return None if get is None else dict(get())


class PlacedRewardModel:
    """A `RewardModel` on the ranks a placement gives it (placement=grouped: e.g.
    beside the critic), scored from every rank: its ranks score (in
    env.reward_model_sharding's layout over them: `sharding`) and the scores
    are broadcast from the first of them, [n] float32 (collective over the
    default group; every rank passes the same sequences).

    Attributes:
        model: the `RewardModel` on its ranks, else None.
        tokenizer: the reward model's tokenizer, on every rank.
        src: the rank the scores come from.
    """

    def __init__(self, path: str, placement: Placement, *, sharding: str = "full") -> None:
        from hybrid_engine.parallel.fsdp import resolve_model_path

        self.src = placement.ranks["reward_model"][0]
        self.model = (RewardModel(path, placement.mesh("reward_model"), sharding=sharding)
                      if placement.holds("reward_model") else None)
        self.tokenizer = (self.model.tokenizer if self.model is not None
                          else _load_tokenizer(resolve_model_path(path), False))

    def score(self, seqs: Sequence[Sequence[int]]) -> Tensor:
        """`RewardModel.score` of seqs from the reward model's ranks, on every rank."""
        out = self.model.score(seqs) if self.model is not None else torch.zeros(len(seqs))
        device = (torch.device("cuda", torch.cuda.current_device())
                  if dist.get_backend() == "nccl" else torch.device("cpu"))
        buf = out.to(device)
        dist.broadcast(buf, src=self.src)
        return buf.cpu()


class RewardModelScorer:
    """A placed reward model's forward on its own ranks, as a scorer of
    `roles.mirrored.Mirrored` (placement=grouped): it fills each trajectory's
    rm_score there (collective over the reward model's ranks only), at the
    same time as the other group's scorers; Mirrored broadcasts the scores and
    the environment's reward takes them (`RewardModelEnv.score`).

    Args:
        env: the run's `RewardModelEnv`, its reward_model a `PlacedRewardModel`
            held by this rank.
    """

    layout = "training"

    def __init__(self, env: RewardModelEnv) -> None:
        if not isinstance(env.reward_model, PlacedRewardModel) or env.reward_model.model is None:
            raise ValueError("RewardModelScorer needs a PlacedRewardModel this rank holds")
        self.env = env

    def score(self, trajs: Sequence[Trajectory]) -> None:
        model = self.env.reward_model.model
        scores = model.score([self.env._rm_ids(t) for t in trajs]).tolist() if trajs else []
        for t, s in zip(trajs, scores, strict=True):
            t.rm_score = float(s)


def placed_reward_scorer(env: Any) -> RewardModelScorer | None:
    """The `RewardModelScorer` of env's reward model (env a `RewardModelEnv`, or
    an env composing one as its `reward_model`, `envs.composed.RewardsEnv`)
    when it is a `PlacedRewardModel` this rank holds; else None."""
    rm_env = env if isinstance(env, RewardModelEnv) else getattr(env, "reward_model", None)
    if (isinstance(rm_env, RewardModelEnv) and isinstance(rm_env.reward_model, PlacedRewardModel)
            and rm_env.reward_model.model is not None):
        return RewardModelScorer(rm_env)
    return None


class RewardModelEnv:
    """An `Environment` whose reward is a reward model's score.

    Prompts, evaluation prompts, checkpoint state and any other attribute
    (e.g. a multi-turn env's `reset` / `step` / `build_trajectory`) come from
    base_env. `score` sets `reward_components = {"rm": s}` and `reward = s`,
    and keeps the task's own reward in `info` for metrics (see the module
    docstring). Collective under a process group, like `RewardModel.score`.

    Token ids: when the reward model's tokenizer has the policy tokenizer's
    vocabulary (or the folder has none), prompt + response ids are scored as
    they are (the prompt already in the policy's chat template). Otherwise,
    when the reward model's tokenizer has a chat template and the prompt's
    problem is known, the conversation -- the prompt's messages as the policy
    saw them (system prompt included), then the response as the assistant's
    turn -- goes through the reward model's own template; else the prompt and
    the response are decoded with the policy tokenizer and their concatenated
    text encoded with the reward model's tokenizer (its own special-token
    conventions, e.g. a BOS).

    Args:
        base_env: the task environment (prompts, task reward).
        reward_model: the scorer (`RewardModel`, or anything with
            `score(seqs) -> Tensor [n]` and a `tokenizer` attribute).
        tokenizer: the policy's tokenizer.
        task_metrics: run base_env's reward for info["task_reward"] etc.
            (False skips it, e.g. for a task with no reference answers).
    """

    # score() runs a model forward: the controller switches to the training
    # layout first (`roles.base.layout_of`), never scoring beside an awake engine.
    layout = "training"

    def __init__(self, base_env: Any, reward_model: RewardModel, tokenizer: Any, *,
                 task_metrics: bool = True) -> None:
        self.base_env = base_env
        self.reward_model = reward_model
        self.tokenizer = tokenizer
        self.task_metrics = task_metrics
        self.name = f"{getattr(base_env, 'name', type(base_env).__name__)}+rm"
        rm_tok = getattr(reward_model, "tokenizer", None)
        self.same_tokens = rm_tok is None or _vocab(rm_tok) == _vocab(tokenizer)

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found normally: delegate to the task.
        if name == "base_env":  # not set yet (e.g. during unpickling)
            raise AttributeError(name)
        return getattr(self.base_env, name)

    def sample_prompts(self, num_prompts: int) -> list[list[int]]:
        """The base environment's next training prompts."""
        return self.base_env.sample_prompts(num_prompts)

    def eval_prompts(self, num_prompts: int) -> list[list[int]]:
        """The base environment's held-out prompts."""
        return self.base_env.eval_prompts(num_prompts)

    def eval_sources(self, num_prompts: int) -> list[str | None]:
        """The base environment's held-out prompts' data sources."""
        return self.base_env.eval_sources(num_prompts)

    def state_dict(self) -> dict[str, Any]:
        """The base environment's prompt-stream state."""
        return self.base_env.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the base environment's prompt-stream state."""
        self.base_env.load_state_dict(state)

    def _rm_ids(self, traj: Trajectory) -> list[int]:
        if self.same_tokens:
            return list(traj.prompt_ids) + list(traj.response_ids)
        rm_tok = self.reward_model.tokenizer
        prompt = decode(self.tokenizer, traj.prompt_ids)
        example_for = getattr(self.base_env, "example_for", None)
        ex = example_for(prompt) if example_for is not None else None
        fmt = getattr(self.base_env, "prompt_format", None)
        if ex is not None and fmt is not None and getattr(rm_tok, "chat_template", None):
            response = decode(self.tokenizer, traj.response_ids)
            msgs = [*fmt.messages(ex.prompt), {"role": "assistant", "content": response}]
            out = rm_tok.apply_chat_template(msgs, tokenize=True)
            return list(out["input_ids"] if isinstance(out, Mapping) else out)
        text = prompt + decode(self.tokenizer, traj.response_ids)
        return list(rm_tok(text)["input_ids"])

    def score(self, trajs: Sequence[Trajectory]) -> None:
        """Fills reward = reward_components["rm"] = the reward model's score (each
        trajectory's rm_score when every one has it, else scored now).

        Raises:
            RewardError: a non-finite score (naming the sample's prompt), or
                the task's reward failing when task_metrics is on. No
                trajectory's reward is changed when a score is not finite.
        """
        if not trajs:
            return
        if self.task_metrics:
            self.base_env.score(trajs)
            for t in trajs:
                t.info["task_reward"] = float(t.reward)
                t.info["task_reward_components"] = dict(t.reward_components)
                if "correct" in t.reward_components:
                    t.info["correct"] = float(t.reward_components["correct"])
        if all(t.rm_score is not None for t in trajs):  # scored beside the other scorers
            scores = [t.rm_score for t in trajs]
        else:
            scores = self.reward_model.score([self._rm_ids(t) for t in trajs]).tolist()
        for t, s in zip(trajs, scores, strict=True):
            if not math.isfinite(s):
                prompt = decode(self.tokenizer, t.prompt_ids)
                raise RewardError(f"environment {self.name!r}, sample with prompt "
                                  f"{prompt[:200]!r}: reward model score {s} is not finite")
        for t, s in zip(trajs, scores, strict=True):
            t.reward_components = {"rm": float(s)}
            t.reward = float(s)


def _seq_cls_architecture(arch: str) -> str:
    """transformers' sequence-classification class of tiny family arch.

    Raises:
        ValueError: transformers has none for that family, or it is a
            Mixture-of-Experts (not written here).
    """
    import transformers

    from hybrid_engine.models.spec import tiny_spec

    family = tiny_spec(arch)
    name = family.architecture.replace("ForCausalLM", "ForSequenceClassification")
    if family.moe or not hasattr(transformers, name):
        raise ValueError(f"{arch}: a tiny reward model needs a dense family with a "
                         f"transformers {name}")
    return name


def write_tiny_reward_model(path: str | os.PathLike, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Writes a random-init `<Arch>ForSequenceClassification` folder (num_labels=1).

    The backbone is `write_tiny_model`'s for the same spec (same names and
    values), the score head [1, H] is drawn like any matrix (seeded by spec
    and name); the tokenizer is the byte-level one of `models.tokenizer`,
    pad_token_id = EOS. spec.vocab_size / tie_word_embeddings concern the
    causal-LM head only: there is no lm_head here.

    Returns:
        The folder, as a `Path`.
    """
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    lm = random_state_dict(dataclasses.replace(spec, tie_word_embeddings=True))
    weights = {n: t for n, t in lm.items() if n.startswith("model.")}
    gen = torch.Generator().manual_seed(spec.seed * 0x9E3779B1 % 2**63 + 1)
    weights["score.weight"] = torch.empty(1, spec.hidden_size).normal_(
        0.0, spec.init_std, generator=gen).to(weights["model.norm.weight"].dtype)
    from safetensors.torch import save_file

    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(spec)
    config.architectures = [_seq_cls_architecture(spec.arch)]
    config.num_labels = 1
    config.pad_token_id = EOS_TOKEN_ID
    config.save_pretrained(folder)
    write_tokenizer_files(folder, model_max_length=spec.max_position_embeddings)
    spec_json = json.dumps(dataclasses.asdict(spec), indent=2, sort_keys=True)
    (folder / "tiny_spec.json").write_text(spec_json + "\n")
    return folder
