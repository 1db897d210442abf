"""Settings read from the environment, checked so that a typo is an error
naming the variable rather than a silently different behaviour."""

from __future__ import annotations

import os


def seconds(name: str, default: float) -> float:
    """The positive number of seconds in environment variable `name`, or
    `default` when it is unset or empty."""
    value = os.environ.get(name, "")
    if not value:
        return default
    try:
        result = float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None
    if result <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return result
