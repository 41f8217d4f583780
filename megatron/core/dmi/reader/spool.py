"""A spool-only store read without chDB: one run's records straight from its verified segments.

A run persisted with ``--dmi-persist spool`` leaves a store folder that holds only ``spool/``: per-rank segments
(``store/segments.py``: raw ``.dmiraw`` ones from the native writer, or Parquet), its ``runs`` and ``topology`` rows
among them (``sinks/meta.py``). ``open_store`` reads such a folder by loading the spool into a chDB snapshot; this
module reads it from the segments themselves, with neither chDB nor pandas (a GPU machine may have neither), by the
same rules: the run a name means and the visible attempt of each (phase, iteration) (``attempts.py``), payloads
checked against their crc32 and tensors rebuilt by ``reconstruct.py``.

    run = open_spool_run(store_dir)                      # the latest run: its attempts, model, layout, topology
    records = run.read_records(output=["router.topk_ids"], phase=["train"])
    ids = records.rebuild("router.topk_ids", iteration=3, microbatch=0, layer=1).values

Damage: a segment that does not verify as a whole (unreadable, a damaged header or block, blocks missing) raises
StoreError naming it, because which records it lost cannot be told; records that fail their own checks while their
keys verify (``verify_segment``'s quarantine, e.g. a payload CRC mismatch) are left out, and their (phase,
iteration) is named in ``SpoolRecords.damaged``.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from megatron.core.dmi import catalog
from megatron.core.dmi.reader.attempts import json_field, pick_run, visible_attempt, visible_attempts
from megatron.core.dmi.reader.errors import AmbiguousLayerError, StoreError, format_ranges
from megatron.core.dmi.reader.reconstruct import Rebuilt, expected_ranks, rebuild, rebuild_each, records_from_table
from megatron.core.dmi.reader.selection import TensorSelection, selecting_in_run
from megatron.core.dmi.records import Record
from megatron.core.dmi.store.segments import (
    CorruptSegmentError,
    Segment,
    VerifiedSegment,
    list_segments,
    verify_segment,
)

# Where a kept record is filed: its tensor's (phase, iteration, attempt, output, invocation, microbatch), then
# its (layer, data-parallel rank).
_Tensor = tuple[str, int, int, str, int, int]


def spool_only(store_dir: str) -> bool:
    """Whether ``store_dir`` is a store folder holding a spool and no chDB store (what ``--dmi-persist spool``
    leaves): ``open_spool_run`` reads it without chDB. A folder with ``chdb/`` holds ingested records and is read
    through chDB (``open_store``, which also loads what its spool still holds)."""
    return os.path.isdir(os.path.join(store_dir, "spool")) and not os.path.isdir(os.path.join(store_dir, "chdb"))


def _verified(seg: Segment) -> VerifiedSegment:
    """The segment's verified records; StoreError when the segment does not verify as a whole."""
    try:
        v = verify_segment(seg)
    except CorruptSegmentError as exc:
        why = str(exc)
    else:
        if not v.problems:
            return v
        why = v.summary(seg.path)
    raise StoreError(
        f"spool segment failed verification: {why}; which records it lost cannot be told, so the spool is not read "
        "without it (megatron-dmi load loads every record that verifies and names what it lost)"
    )


@dataclass
class SpoolRun:
    """One run of a spool-only store: its ``runs`` row per attempt and its ``topology`` rows (chDB-free)."""

    location: str  # the store folder
    run_id: str
    attempts: dict[int, dict[str, Any]]  # attempt -> its runs row (the lowest rank's)
    topology: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # attempt -> one row per rank

    @property
    def latest(self) -> dict[str, Any]:
        """The runs row of the latest attempt ({} when the run has none)."""
        return self.attempts[max(self.attempts)] if self.attempts else {}

    @property
    def model(self) -> dict[str, Any]:
        """The latest attempt's model summary (``provenance.model_summary``)."""
        return json_field(self.latest.get("model_json"))

    @property
    def layout(self) -> dict[str, Any]:
        """The latest attempt's parallel group sizes (``provenance.parallel_layout``)."""
        return json_field(self.latest.get("layout_json"))

    def read_records(self, **where: Collection) -> SpoolRecords:
        """Read the run's tensor segments, keeping the records whose key columns hold one of the values ``where``
        names (``output=[...]``, ``layer=[...]``, any ``KEY_COLUMNS`` name); every record still counts for which
        attempt is visible and which layers an output was recorded at.

        Raises:
            StoreError: a segment does not verify as a whole (``_verified``).
        """
        spool = os.path.join(self.location, "spool")
        present: set[tuple[str, int, int]] = set()
        layers: dict[tuple[str, str, int, int], set[int]] = defaultdict(set)
        kept: dict[_Tensor, dict[tuple[int, int], list[Record]]] = defaultdict(lambda: defaultdict(list))
        damage: dict[tuple[str, int, int], str] = {}
        for seg in list_segments(spool):
            if seg.kind != "tensors":
                continue
            v = _verified(seg)
            table = v.table.filter(pc.equal(v.table.column("run_id"), self.run_id))
            names = ["phase", "output", "iteration", "attempt", "layer"]
            for row in table.select(names).group_by(names).aggregate([]).to_pylist():
                present.add((row["phase"], row["iteration"], row["attempt"]))
                layers[(row["phase"], row["output"], row["iteration"], row["attempt"])].add(row["layer"])
            for name, values in where.items():
                table = table.filter(
                    pc.is_in(table.column(name), pa.array(list(values), table.schema.field(name).type))
                )
            for r in records_from_table(table):
                k = r.key
                kept[(k.phase, k.iteration, k.attempt, k.output, k.invocation, k.microbatch)][
                    (k.layer, k.coords.dp)
                ].append(r)
            for q in v.quarantined:  # records whose own checks failed; their keys verified (else _verified raised)
                key = q.key
                if key.get("run_id", self.run_id) != self.run_id or any(
                    name in key and key[name] not in values for name, values in where.items()
                ):
                    continue
                place = (key["phase"], int(key["iteration"]), int(key["attempt"]))
                present.add(place)
                damage.setdefault(place, f"{os.path.relpath(seg.path, spool)} failed verification ({q.reason})")
        resumed = {a: int(row["resumed_from_iteration"]) for a, row in self.attempts.items()}
        visible = visible_attempts(present, resumed)
        damaged = {
            (p, it): f"a record in spool segment {why}"
            for (p, it, a), why in damage.items()
            if visible.get((p, it)) == a
        }
        return SpoolRecords(self, visible, damaged, dict(layers), dict(kept))


@dataclass
class SpoolRecords:
    """The records ``SpoolRun.read_records`` kept, and what every record of the run tells: which attempt of each
    (phase, iteration) is visible, at which layers each output was recorded, which iterations lost records."""

    run: SpoolRun
    visible: dict[tuple[str, int], int]  # (phase, iteration) -> the visible attempt
    damaged: dict[tuple[str, int], str]  # visible (phase, iteration) -> why some of its records were left out
    _layers: dict[tuple[str, str, int, int], set[int]]  # (phase, output, iteration, attempt) -> layers
    _kept: dict[_Tensor, dict[tuple[int, int], list[Record]]]

    @property
    def run_id(self) -> str:
        """The run these records are of."""
        return self.run.run_id

    def iterations(self, phase: str = "train") -> list[int]:
        """The visible iterations of ``phase``."""
        return sorted(i for p, i in self.visible if p == phase)

    def layers(self, output: str, phase: str = "train") -> set[int]:
        """The layers ``output`` was recorded at in the visible iterations of ``phase``."""
        out: set[int] = set()
        for (p, o, it, a), found in self._layers.items():
            if p == phase and o == output and self.visible.get((p, it)) == a:
                out |= found
        return out

    @selecting_in_run
    def records(self, sel: TensorSelection) -> list[Record]:
        """The kept shards of one tensor, from the visible attempt (StoreError when no attempt holds the
        iteration), as ``Store.records`` selects them: ``layer=None``, at the one layer they were kept at
        (AmbiguousLayerError when several); ``dp=None``, those of every data-parallel rank."""
        attempt = visible_attempt(self.visible, self.run_id, sel.phase, sel.iteration)
        at = self._kept.get((sel.phase, int(sel.iteration), attempt, sel.output, sel.invocation, sel.microbatch), {})
        at = {(layer, dp): recs for (layer, dp), recs in at.items() if sel.dp is None or dp == sel.dp}
        layer = sel.layer
        if layer is None:
            layers = sorted({layer for layer, _ in at})
            if len(layers) > 1:
                raise AmbiguousLayerError(sel.output, sel.iteration, format_ranges(layers))
            layer = layers[0] if layers else None
        return [r for (at_layer, _), recs in sorted(at.items()) if at_layer == layer for r in recs]

    @selecting_in_run
    def rebuild(self, sel: TensorSelection) -> Rebuilt:
        """One full tensor, as ``Store.rebuild`` rebuilds it (``mlp.experts``, gathered from every rank's records,
        is read through a store). Raises ReconstructionError on no records, a gap, an overlap or a conflict."""
        sel.check_one_rank()
        spec = catalog.BY_NAME.get(sel.output)
        if spec is not None and spec.combine == "rows":
            raise StoreError(f"{sel.output} is rebuilt from every rank's records by a store: load the spool into one")
        recs = self.records(sel)
        if not recs:
            raise sel.no_records(sel.layer)
        what = sel.what(recs[0].key.layer)
        topology = self.run.topology.get(recs[0].key.attempt, [])
        return rebuild(recs, sel.output, what=what, expected_ranks=expected_ranks(topology, recs[0].key))

    def rebuild_each(
        self, output: str, phase: str = "train", invocation: int = 0
    ) -> dict[tuple[int, int, int, int], Rebuilt]:
        """Every visible kept tensor of ``output`` in ``phase``, by (iteration, microbatch, layer, data-parallel
        rank), as ``Store.rebuild_each`` returns them."""
        recs = [
            r
            for (p, it, a, o, inv, _), at in self._kept.items()
            if p == phase and o == output and inv == invocation and self.visible.get((p, it)) == a
            for rs in at.values()
            for r in rs
        ]
        return rebuild_each(recs, output, what=f"{output} run {self.run.run_id} {phase}")


def open_spool_run(store_dir: str, run_id: str | None = None) -> SpoolRun:
    """The run ``run_id`` (the latest when None, as ``Store.resolve_run`` picks it) of the spool-only store at
    ``store_dir``, from the ``runs`` and ``topology`` segments of its spool; its tensors come with
    ``SpoolRun.read_records``.

    Raises:
        StoreError: no such run, a store without runs, or a metadata segment that does not verify.
    """
    spool = os.path.join(store_dir, "spool")
    rows: dict[str, list[dict[str, Any]]] = {"runs": [], "topology": []}
    for seg in list_segments(spool):
        if seg.kind in rows:
            rows[seg.kind] += _verified(seg).table.to_pylist()
    started: dict[str, Any] = {}
    for row in rows["runs"]:
        started[row["run_id"]] = min(row["started_at"], started.get(row["run_id"], row["started_at"]))
    run = pick_run(sorted(started, key=lambda r: (started[r], r)), run_id, store_dir)
    attempts: dict[int, dict[str, Any]] = {}
    for row in sorted((r for r in rows["runs"] if r["run_id"] == run), key=lambda r: r["rank"]):
        attempts.setdefault(int(row["attempt"]), row)
    topology: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in sorted((r for r in rows["topology"] if r["run_id"] == run), key=lambda r: r["rank"]):
        topology[int(row["attempt"])].append(row)
    return SpoolRun(store_dir, run, attempts, dict(topology))


__all__ = ["SpoolRecords", "SpoolRun", "open_spool_run", "spool_only"]
