"""Names a user types (recipes, config keys, registry entries): registries and the
"did you mean" hint.

Job: `closest(name, names)` gives the valid names nearest a typo
(`difflib.get_close_matches`); `unknown_name_error(kind, name, names)` is the
one error every registry raises for an unknown name: the valid names, and
the closest one when there is one. `Registry` maps config strings to what
they name (advantage estimators, environments, placements, model families).

Invariant: a name is registered once, and a lookup never silently falls back
to a default: an unknown name is a `ValueError`.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Generic, TypeVar

__all__ = ["Registry", "closest", "did_you_mean", "unknown_name_error"]


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


T = TypeVar("T")


class Registry(Generic[T]):
    """A name -> item map whose lookups raise `unknown_name_error`."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def add(self, name: str, item: T) -> None:
        """Registers item under name (each name once)."""
        assert name not in self._items, f"{self.kind} {name!r} registered twice"
        self._items[name] = item

    def get(self, name: str) -> T:
        """The item registered as name.

        Raises:
            ValueError: no such name; lists the valid names and the closest one.
        """
        item = self._items.get(name)
        if item is None:
            raise unknown_name_error(self.kind, name, self._items)
        return item

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items
