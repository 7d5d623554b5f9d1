"""What the `hybrid-engine` command prints: this package's lines, without the
libraries' chatter.

Job: `quiet_libraries()` runs first thing in every rank's CLI, before torch or
vLLM is imported, because both read their log settings then; `configure_logging()`
then sets up Python logging once the rank is known:

    default    rank 0: this package's INFO lines (start-up phases, the per-step
               line) and every logger's warnings; other ranks: warnings.
               vLLM logs errors only (VLLM_LOGGING_LEVEL=ERROR, as TRL sets
               it), torch's C++ side errors only (TORCH_CPP_LOG_LEVEL=ERROR),
               and the deprecation notices libraries raise about each other
               are hidden; vLLM's own progress bars are off (`show_progress`),
               as are MLflow's and W&B's hints (W&B's run summary stays).
    verbose    (--verbose, or HE_VERBOSE=1 in the environment, which the
               launcher passes to the ranks) nothing is changed: every library
               logs as it would.

A variable the user set already (VLLM_LOGGING_LEVEL=DEBUG) always wins.
An embedding trainer that never runs the CLI keeps its own logging untouched.
"""

from __future__ import annotations

import logging
import os
import warnings

__all__ = ["configure_logging", "quiet_libraries", "show_progress", "verbose"]

_VERBOSE_ENV = "HE_VERBOSE"
_QUIET_ENV = {"VLLM_LOGGING_LEVEL": "ERROR", "TORCH_CPP_LOG_LEVEL": "ERROR",
              # W&B's hint to trace openai calls (vLLM imports openai) and MLflow's
              # bar per table appended: nothing a user acts on.
              "WANDB_DISABLE_WEAVE": "true", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}


def verbose() -> bool:
    """Whether this process logs everything (--verbose)."""
    return os.environ.get(_VERBOSE_ENV, "") not in ("", "0")


def quiet_libraries(verbose_flag: bool = False) -> None:
    """Before torch and vLLM are imported: their INFO output off unless verbose
    (verbose_flag records it in the environment, for the ranks a launcher starts)."""
    if verbose_flag:
        os.environ[_VERBOSE_ENV] = "1"
    if verbose():
        return
    for key, value in _QUIET_ENV.items():
        os.environ.setdefault(key, value)
    # e.g. vLLM calling torch.distributed.reduce_op: nothing a user can act on.
    for category in (FutureWarning, DeprecationWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category,
                                module=r"(vllm|torch|transformers|mlflow|wandb)\b")


def show_progress() -> bool:
    """Whether library progress bars (vLLM's weight loading) may draw."""
    return verbose()


def configure_logging() -> None:
    """This package's INFO lines on rank 0, warnings from every logger on every
    rank (everything at INFO when verbose)."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if verbose() else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if rank == 0:
        logging.getLogger("hybrid_engine").setLevel(logging.INFO)
    if not verbose():
        # torch logs through its own handlers: its INFO and warnings about
        # missing optional kernels (Triton) are not the user's to act on.
        logging.getLogger("torch").setLevel(logging.ERROR)
