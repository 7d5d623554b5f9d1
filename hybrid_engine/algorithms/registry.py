"""Name registries of algorithm components (advantages, policy losses, KL).

Job: map a config string (`algorithm.advantage="grpo"`) to the component it
names, and turn a typo into an error that lists the valid names and suggests
the closest one.

Invariant: a name is registered once, and a lookup never silently falls back
to a default: an unknown name is a `ValueError`.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from hybrid_engine.names import unknown_name_error

__all__ = ["Registry"]

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
