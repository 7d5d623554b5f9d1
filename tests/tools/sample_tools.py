"""Real tools for the tests: loaded by file path and by module name."""

from __future__ import annotations

from typing import Literal


def get_weather(city: str, days: int = 1, unit: Literal["c", "f"] = "c") -> dict:
    """The forecast for a city.

    Args:
        city: The city's name.
        days: How many days ahead.
        unit: Celsius or Fahrenheit.
    """
    return {"city": city, "days": days, "unit": unit, "sky": "sunny"}


def add(a: float, b: float) -> float:
    """Adds two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def search(query: str, tags: list[str] | None = None, limits: dict[str, int] | None = None,
           exact: bool = False) -> str:
    """Searches the notes.

    Args:
        query: What to look for.
        tags: Only notes with these tags.
        limits: Per-source result limits.
        exact: Match the whole query.
    """
    return f"3 notes match {query!r}"


def now() -> str:
    """The current time, fixed for tests."""
    return "12:00"


def fails(x: int) -> str:
    """Always raises.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"tool broke on {x}")


def no_hints(city):  # noqa: ANN001, ANN201 - refused on purpose
    """No type hints.

    Args:
        city: The city.
    """
    return city


def no_arg_docs(city: str) -> str:
    """Its argument is not described."""
    return city


NOT_A_FUNCTION = 3
