"""The rules every reader applies to a run, whatever it reads from (a chDB or server store, or a spool
read straight from its segments, ``reader/spool.py``): which run a name means, and which attempt's
records of each (phase, iteration) are visible. Pure functions, no storage, no pandas."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence

from megatron.core.dmi.reader.errors import StoreError, format_ranges


def pick_run(runs: Sequence[str], run_id: str | None, location: str) -> str:
    """``run_id`` itself, or the latest of ``runs`` (ordered oldest first) when None; StoreError naming the runs
    when the store holds none or not that one."""
    if not runs:
        raise StoreError(f"the store at {location} holds no runs")
    if run_id is None:
        return str(runs[-1])
    if run_id not in set(runs):
        raise StoreError(f"no run {run_id!r} in {location} (runs: {', '.join(map(str, runs))})")
    return run_id


def visible_attempts(present: Iterable[tuple[str, int, int]], resumed: Mapping[int, int]) -> dict[tuple[str, int], int]:
    """(phase, iteration) -> the attempt whose records a reader sees (DESIGN section 7).

    Args:
        present: every (phase, iteration, attempt) the run holds records of.
        resumed: attempt -> the checkpoint iteration it resumed from (-1: a fresh start).

    Returns:
        For each (phase, iteration), the latest attempt holding it that no later attempt superseded: attempt
        ``a``'s records for iterations after the checkpoint a later attempt resumed from are not visible.
    """
    present = set(present)
    cutoff: dict[int, float] = {}
    for a in {a for _, _, a in present} | set(resumed):
        later = [r for b, r in resumed.items() if b > a and r >= 0]
        cutoff[a] = min(later) if later else math.inf
    vis: dict[tuple[str, int], int] = {}
    for phase, iteration, attempt in present:
        if iteration <= cutoff[attempt] and attempt > vis.get((phase, iteration), -1):
            vis[(phase, iteration)] = attempt
    return vis


def visible_attempt(visible: Mapping[tuple[str, int], int], run_id: str, phase: str, iteration: int) -> int:
    """The attempt whose records of (``phase``, ``iteration``) are visible; StoreError naming the captured
    iterations when none is."""
    attempt = visible.get((phase, int(iteration)))
    if attempt is None:
        its = sorted(i for p, i in visible if p == phase)
        raise StoreError(
            f"run {run_id!r} has no {phase} records at iteration {iteration}"
            + (f" (captured: {format_ranges(its)})" if its else "")
        )
    return attempt


def json_field(text: str | None) -> dict:
    """A runs row's JSON column (model, layout, config, versions) as a dict; {} when empty or damaged (a damaged
    row must not stop a reader)."""
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return {}
