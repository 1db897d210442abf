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


def bind_host(advertised: str) -> str:
    """The address a listening socket binds for a process that advertises
    ``advertised`` (the host name or address Spark uses for its executor or
    driver): that address, so a port is reachable only where peers are told to
    connect.  ``EMBER_BIND_ALL=1`` binds every interface instead (0.0.0.0),
    e.g. behind NAT where the advertised address is not a local one."""
    value = os.environ.get("EMBER_BIND_ALL", "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return ""
    if value not in ("", "0", "false", "no", "off"):
        raise ValueError(f"EMBER_BIND_ALL must be 1 or 0, got {value!r}")
    return advertised
