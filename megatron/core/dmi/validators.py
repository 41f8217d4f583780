"""Value checks that DMIConfig's fields and the torch-free commands share.

``config.py`` imports torch, and a ``megatron-dmi`` command that only reads or ingests never does
(``megatron-dmi ingest`` runs beside training on every node), so the checks both need live here,
below config, with the error they raise. ``argparse_type`` makes any of them (or any parser that
raises a ``ValueError`` saying why) an argparse type whose refusal is argparse's one-line error.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from megatron.core.dmi.errors import DMIError

# The largest increment ``nice`` takes: 19 is the lowest CPU priority.
NICE_MAX = 19


class ConfigValueError(DMIError, ValueError):
    """A value a DMIConfig field (or the flag of one) cannot take."""


def _integer(value: str | int, low: int, high: int | None, expected: str) -> int:
    """``value`` (text or an int, not a bool) as an integer from ``low`` to ``high`` (None: no limit)."""
    try:
        n = int(value) if isinstance(value, str) else value
    except ValueError:
        n = None
    if not isinstance(n, int) or isinstance(n, bool) or n < low or (high is not None and n > high):
        raise ConfigValueError(f"expected {expected}, got {value!r}")
    return n


def number(value: str | float, expected: str) -> float:
    """``value`` (text or a number, not a bool) as a float; ConfigValueError saying ``expected`` if it is none."""
    try:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return float(value)
    except ValueError:
        pass
    raise ConfigValueError(f"expected {expected}, got {value!r}")


def positive_seconds(value: str | float) -> float:
    """An interval: finite seconds above 0.

    Args:
        value: the flag's text or a number.

    Returns:
        The seconds.

    Raises:
        ConfigValueError: not a number, or not finite and above 0.
    """
    seconds = number(value, "a number of seconds")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigValueError(f"expected a number of seconds above 0, got {value!r}")
    return seconds


def positive_int(value: str | int) -> int:
    """A count or a 1-based iteration.

    Args:
        value: the flag's text or an int.

    Returns:
        The integer, at least 1.

    Raises:
        ConfigValueError: not an integer, or below 1.
    """
    return _integer(value, 1, None, "a positive integer")


def nice_increment(value: str | int) -> int:
    """How much lower a helper process's CPU priority is (``nice``): an integer from 0 to ``NICE_MAX``."""
    return _integer(value, 0, NICE_MAX, f"an integer from 0 to {NICE_MAX}")


def argparse_type[T](parse: Callable[[str], T]) -> Callable[[str], T]:
    """``parse`` as an argparse type: the ``ValueError`` that says why a value is refused becomes
    argparse's one-line error (for a plain ``ValueError`` argparse prints only "invalid value")."""

    def parse_arg(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse_arg


__all__ = [
    "NICE_MAX",
    "ConfigValueError",
    "argparse_type",
    "nice_increment",
    "number",
    "positive_int",
    "positive_seconds",
]
