"""Names a user types (recipes, config keys, registry entries): the "did you mean" hint.

Job: `closest(name, names)` gives the valid names nearest a typo
(`difflib.get_close_matches`); `unknown_name_error(kind, name, names)` is the
one error every registry raises for an unknown name: the valid names, and
the closest one when there is one.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["closest", "did_you_mean", "unknown_name_error"]


def closest(name: str, names: Iterable[str], n: int = 1, cutoff: float = 0.5) -> list[str]:
    """Up to n of names nearest to name, best first (none below cutoff)."""
    return difflib.get_close_matches(name, list(names), n=n, cutoff=cutoff)


def did_you_mean(matches: Iterable[str]) -> str:
    """"did you mean 'a' or 'b'? " for the matches; "" for none."""
    matches = list(matches)
    return f"did you mean {' or '.join(repr(m) for m in matches)}? " if matches else ""


def unknown_name_error(kind: str, name: str, names: Iterable[str]) -> ValueError:
    """ValueError for an unknown name: lists the valid names and the closest one.

    Args:
        kind: what is being looked up, for the message ("advantage estimator").
        name: the name that was not found.
        names: the valid names.
    """
    valid = sorted(names)
    return ValueError(f"unknown {kind} {name!r}; {did_you_mean(closest(name, valid))}"
                      f"available: {', '.join(valid)}")
