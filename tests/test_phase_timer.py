"""PhaseTimer splits each phase's time into wall, user CPU and system CPU
(system time per step matters on CPU). Page faults are system time: touching fresh
memory must show up as <phase>_sys_s, busy Python as <phase>_user_s, and a
sleep as neither."""

from __future__ import annotations

import mmap
import time

from hybrid_engine.metrics import PhaseTimer


def test_phases_split_wall_user_and_system_time() -> None:
    timer = PhaseTimer()
    with timer.phase("fault"):  # 512 MiB of fresh anonymous pages: one fault per 4 KiB page
        buf = mmap.mmap(-1, 512 << 20)
        for off in range(0, len(buf), 4096):
            buf[off] = 1
        buf.close()
    with timer.phase("busy"):
        t0 = time.process_time()
        while time.process_time() - t0 < 0.3:
            sum(range(1000))
    with timer.phase("sleep"):
        time.sleep(0.3)
    with timer.phase("sleep"):  # a phase entered twice in a step accumulates
        time.sleep(0.1)
    m = timer.metrics
    assert m["fault_sys_s"] > 0.02, m
    assert m["busy_user_s"] >= 0.25 and m["busy_sys_s"] < 0.1, m
    assert m["sleep_s"] >= 0.4 and m["sleep_user_s"] + m["sleep_sys_s"] < 0.05, m
    for name in ("fault", "busy", "sleep"):
        assert m[f"{name}_user_s"] + m[f"{name}_sys_s"] <= m[f"{name}_s"] + 0.05, m
