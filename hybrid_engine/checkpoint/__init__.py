"""Resumable training checkpoints (sharded DCP) and HF export of the policy.

Job: `save_training_state` / `load_training_state` write and restore
everything a run needs to continue as if it had never stopped: the FSDP2
policy and its AdamW state (torch.distributed.checkpoint, every rank writing
its own shards), the LR schedule and step count, the critic's model,
optimizer and schedule when there is one, every rank's RNG states, and the
controller's JSON-able `extra`. `export_hf` writes the policy as a plain HF
folder that `AutoModelForCausalLM.from_pretrained` loads; `export_adapter` a
LoRA policy's adapters as a PEFT folder.

Invariant (atomic commit): a folder at `path` is a complete checkpoint. All
ranks write into `<path>.tmp-<token>`; after a barrier rank 0 writes the
`COMPLETE` marker, then renames the folder to `path`. A crash at any point
before that leaves only a `.tmp-` folder (no marker), which
`load_training_state` rejects with a ValueError; a previous checkpoint at
another path is never touched.

Integrity: `folders.commit` also writes MANIFEST.json (every file's size and CRC-32,
computed by the ranks in parallel). `checkpoint_problem` re-reads the files
against it, so a truncated, missing or bit-flipped shard is named before
anything loads it; the run's resume then falls back to the checkpoint before
(`job.JobCheckpointer`). A save that fails on any rank (full disk, I/O error)
fails on every rank with one `CheckpointWriteError` that says why, and the
half-written folder is removed: the previous checkpoint stays the newest.

Layout of a checkpoint folder:
    dcp/            DCP shards + metadata: "model", "optim" (+ "critic_model",
                    "critic_optim"), keyed by HF parameter names
    rng/rank{r}.pt  torch CPU (+ CUDA), python `random` and numpy states of rank r
    meta.json       world size, trainer step + scheduler (+ critic's), extra,
                    origin: the model the run was made from (`origin.run_origin`:
                    architecture, config, weights sha256, LoRA rank), which
                    --resume checks first (`origin.check_resume_model`)
    MANIFEST.json   {file: [bytes, crc32]} of every file above
    COMPLETE        written last
"""

from hybrid_engine.checkpoint.export import export_adapter, export_hf
from hybrid_engine.checkpoint.folders import (COMPLETE_MARKER, CheckpointWriteError,
                                              checkpoint_problem, latest_checkpoint,
                                              prune_checkpoints, step_checkpoint_path,
                                              step_checkpoints)
from hybrid_engine.checkpoint.origin import check_resume_model
from hybrid_engine.checkpoint.state import load_training_state, save_training_state

__all__ = [
    "COMPLETE_MARKER",
    "CheckpointWriteError",
    "check_resume_model",
    "checkpoint_problem",
    "export_adapter",
    "export_hf",
    "latest_checkpoint",
    "load_training_state",
    "prune_checkpoints",
    "save_training_state",
    "step_checkpoint_path",
    "step_checkpoints",
]
