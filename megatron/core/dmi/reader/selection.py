"""Which stored tensor a reader's tensor methods read: ``TensorSelection``, declared once for both readers
(``Store`` through chDB, ``SpoolRecords`` from a spool's segments), with neither chDB nor pandas."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron.core.dmi.errors import InvalidArgumentError
from megatron.core.dmi.reader.errors import ReconstructionError, StoreError


@dataclass(frozen=True)
class TensorSelection:
    """One stored tensor: ``output`` of run ``run_id`` at ``iteration`` (1-based) and ``microbatch`` of
    ``phase``, at global ``layer`` (None: the one layer the run captured it at), data-parallel rank
    ``dp`` (None, for ``records`` only: every rank's) and ``invocation`` (1: an activation-recompute
    replay kept by ``--dmi-record-replays``). ``Store.records``, ``rebuild``, ``array`` and ``tensor``
    take these fields, positionally or by name, or one ``TensorSelection``; ``SpoolRecords.records`` and
    ``rebuild``, which read one run, take them without ``run_id``."""

    run_id: str
    output: str
    iteration: int
    microbatch: int = 0
    layer: int | None = None
    phase: str = "train"
    dp: int | None = 0
    invocation: int = 0

    def what(self, layer: int | None) -> str:
        """The tensor at ``layer`` (the one its records hold), as a rebuild's errors name it."""
        return (
            f"{self.output} run {self.run_id} {self.phase} iteration {self.iteration} "
            f"microbatch {self.microbatch} layer {layer}"
        )

    def no_records(self, layer: int | None) -> ReconstructionError:
        """The error of a rebuild that found no records of this tensor at ``layer``."""
        return ReconstructionError(f"{self.what(layer)}: no records (dp {self.dp}, invocation {self.invocation})")

    def check_one_rank(self) -> None:
        """InvalidArgumentError unless ``dp`` names one data-parallel rank: a tensor is rebuilt for one."""
        if self.dp is None:
            raise InvalidArgumentError(
                f"{self.output}: a tensor is rebuilt for one data-parallel rank (dp), not None; "
                "records(..., dp=None) returns every rank's shards"
            )


def _taking_fields[R](method: Callable[[Any, TensorSelection], R], of_run: bool) -> Callable[..., R]:
    """``method(reader, selection)`` as a method that takes ``TensorSelection``'s fields positionally or by
    name (its signature says so, for ``help`` and editors), or one selection. ``of_run``: the reader reads
    one run, ``reader.run_id``, so the fields start after ``run_id`` and a selection must name that run."""
    fields = list(inspect.signature(TensorSelection).parameters.values())[1 if of_run else 0 :]

    @functools.wraps(method)
    def with_fields(self: Any, *values: Any, **by_name: Any) -> R:
        given = values[0] if len(values) == 1 and not by_name else None
        if not isinstance(given, TensorSelection):
            given = TensorSelection(self.run_id, *values, **by_name) if of_run else TensorSelection(*values, **by_name)
        elif of_run and given.run_id != self.run_id:
            raise StoreError(f"this reader reads run {self.run_id!r}, not {given.run_id!r}")
        return method(self, given)

    own = inspect.signature(method)
    with_fields.__signature__ = own.replace(parameters=[own.parameters["self"], *fields])
    return with_fields


def selecting[R](method: Callable[[Any, TensorSelection], R]) -> Callable[..., R]:
    """A reader of many runs' tensor method: it takes every field of ``TensorSelection`` (``Store``'s)."""
    return _taking_fields(method, of_run=False)


def selecting_in_run[R](method: Callable[[Any, TensorSelection], R]) -> Callable[..., R]:
    """A reader of one run's tensor method: it takes the fields after ``run_id`` (``SpoolRecords``')."""
    return _taking_fields(method, of_run=True)


__all__ = ["TensorSelection", "selecting", "selecting_in_run"]
