"""Session-wide hooks of the test suite."""

from __future__ import annotations


import re
import time

import pytest

_SESSION_START = time.time()


def pytest_collection_modifyitems(config, items) -> None:  # noqa: ARG001 - pytest's signature
    """Implements the `gpu` marker: without CUDA, every test marked gpu is skipped with
    the reason (`make gpu-check` runs exactly these where a GPU is present)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu: needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus) -> None:  # noqa: ARG001 - pytest's signature
    """Leaves the machine clean: removes the vLLM-CPU shared-memory segments that
    ranks killed on purpose (tests/test_faults.py) could not unlink: ours (each
    engine start sweeps them too; this catches the last ones) and vLLM's own
    `psm_*` ring buffers (24 MiB per TP group) changed during this session and
    mapped by no live process (`cpu_shm.sweep_orphans`)."""
    from hybrid_engine.rollout import cpu_shm

    removed = cpu_shm.sweep_orphans(min_age_s=10) + cpu_shm.sweep_orphans(
        min_age_s=10, pattern=re.compile(r"psm_[0-9a-f]+"), changed_after=_SESSION_START)
    if removed:
        print(f"\nremoved {len(removed)} orphaned /dev/shm segment(s) of killed test jobs")


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """Two tiny models of one architecture with different random weights (the
    weights before and after a "sync"), as HF folders: (a, b)."""
    import dataclasses

    from hybrid_engine.models.tiny import PRESETS, write_tiny_model

    base, spec = tmp_path_factory.mktemp("models"), PRESETS["tiny"]
    return (str(write_tiny_model(base / "a", spec)),
            str(write_tiny_model(base / "b", dataclasses.replace(spec, seed=1))))
