"""Fixtures of the whole-run policy tests (separate placement, generation ahead)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory) -> Path:
    """A reward with signal in every group (so every step trains and syncs)."""
    f = tmp_path_factory.mktemp("reward") / "coin.py"
    f.write_text("import hashlib\n\ndef reward(prompt, completion, answer):\n"
                 "    return float(hashlib.md5(completion.encode()).digest()[0] % 2)\n")
    return f
