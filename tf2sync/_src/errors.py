"""Error helpers: every message names the argument and the value received."""

from __future__ import annotations


def config_error(argument: str, value, what: str) -> ValueError:
    """A `ValueError` in the form "`arg`: what. Received: arg=value"."""
    return ValueError(f"`{argument}`: {what}. Received: {argument}={value!r}")
