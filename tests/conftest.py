"""Session-wide hooks of the test suite."""

from __future__ import annotations


def pytest_sessionfinish(session, exitstatus) -> None:  # noqa: ARG001 - pytest's signature
    """Leaves the machine clean: removes the vLLM-CPU shared-memory segments that
    ranks killed on purpose (tests/test_faults.py) could not unlink. Each engine
    start sweeps them too; this catches the last ones (`cpu_shm.sweep_orphans`)."""
    from hybrid_engine.roles import cpu_shm

    removed = cpu_shm.sweep_orphans(min_age_s=10)
    if removed:
        print(f"\nremoved {len(removed)} orphaned /dev/shm segment(s) of killed test jobs")
