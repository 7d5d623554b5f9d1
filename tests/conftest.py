"""Session-wide hooks of the test suite."""

from __future__ import annotations


import re
import time

import pytest

_SESSION_START = time.time()
# The whole suite's budget on a 2-core CPU machine: CI's .ci/run allows 35 minutes,
# of which the install takes about 2; README.md states the measured time.
SUITE_BUDGET_S = 33 * 60


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


@pytest.hookimpl(trylast=True)  # after --durations' table
def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001
    """The session's time against the suite's budget, flagged when a whole-suite
    run (no -m, -k or paths) exceeds it, so growth shows when it happens."""
    elapsed = time.time() - _SESSION_START
    whole = not config.option.markexpr and not config.option.keyword and \
        config.args in ([], ["tests"], [str(config.rootpath / "tests")])
    if not whole:
        return
    line = (f"suite time: {elapsed / 60:.1f} min "
            f"(budget {SUITE_BUDGET_S / 60:.0f} min on 2 CPU cores)")
    if elapsed > SUITE_BUDGET_S:
        terminalreporter.write_line(f"OVER BUDGET -- {line}: see the slowest tests above "
                                    "(make test: --durations=25)", red=True, bold=True)
    else:
        terminalreporter.write_line(line)


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


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """The tiny preset as a HF folder (random weights, the offline chat tokenizer),
    written once per session. Tests read it; a test that needs it changed copies it."""
    from hybrid_engine.models.tiny import PRESETS, write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("model") / "tiny", PRESETS["tiny"]))


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """Two tiny models of one architecture with different random weights (the
    weights before and after a "sync"), as HF folders: (a, b)."""
    import dataclasses

    from hybrid_engine.models.tiny import PRESETS, write_tiny_model

    base, spec = tmp_path_factory.mktemp("models"), PRESETS["tiny"]
    return (str(write_tiny_model(base / "a", spec)),
            str(write_tiny_model(base / "b", dataclasses.replace(spec, seed=1))))
