"""The reader: open a DMI store (embedded chDB directory or ClickHouse URL) and answer questions.

An embedded store is read through a private snapshot (reader/snapshot.py): readers never hold the
store itself, so they run beside a training run's ingester, and they leave the store's data and
spool as they found them. What a reader does write: its snapshot under ``<store>/.readers/`` (hard
links plus the snapshot's own chDB files, into which it loads the spool segments the store lacks;
removed on close, and a killed reader's by the next reader on its host); on a ClickHouse server,
the DMI tables (``ensure_schema``) when the database lacks them. ``writable=True`` (``load``) opens
and writes the store itself. torch is imported only by the methods that return tensors.

Every query sees each (phase, iteration) exactly once, from its latest attempt: attempt ``a``'s
records for iterations after the checkpoint that a later attempt ``b`` resumed from are
superseded (DESIGN section 7).
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import pyarrow as pa

from megatron.core.dmi import catalog
from megatron.core.dmi.errors import InvalidArgumentError
from megatron.core.dmi.reader.attempts import json_field, pick_run, visible_attempt, visible_attempts
from megatron.core.dmi.reader.errors import (
    AmbiguousLayerError,
    DiskFullError,
    NotAStoreError,
    StoreError,
    format_ranges,
)
from megatron.core.dmi.reader.reconstruct import (
    Rebuilt,
    expected_ranks,
    rebuild,
    rebuild_each,
    rebuild_expert_rows,
    records_from_table,
)
from megatron.core.dmi.reader.selection import TensorSelection, selecting
from megatron.core.dmi.reader.snapshot import ReaderSnapshot, SnapshotStats, link_spool, link_store, out_of_space
from megatron.core.dmi.records import TENSOR_SCHEMA, Record
from megatron.core.dmi.store import schema as S
from megatron.core.dmi.store.backend import Backend, ChdbBackend, ServerBackend, StoreBusyError
from megatron.core.dmi.store.ingest import IngestResult, ingest_spool

if TYPE_CHECKING:
    import torch

# Every column of a stored record, in TENSOR_SCHEMA's order (RecordKey.from_flat reads the key's).
_RECORD_SELECT = ", ".join(TENSOR_SCHEMA.names)
_URL_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_VISIBLE = (
    "attempt = transform(concat(phase, ':', toString(iteration)), {vis_keys:Array(String)}, "
    "{vis_attempts:Array(Int32)}, toInt32(-1))"
)


@dataclass
class RunDescription:
    """What a store holds of one run: its attempts, outputs, layers and visible iterations."""

    run_id: str
    attempts: pd.DataFrame  # attempt, resumed_from_iteration, started_at, world_size, versions_json, ended
    outputs: pd.DataFrame  # phase, output, records, bytes, layers, n_iterations, first/last iteration, ranks
    layers: list[int]
    iterations: dict[str, list[int]]  # phase -> visible iterations
    records: int
    bytes: int
    superseded_records: int
    dropped_records: int
    config: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)  # of the latest attempt (provenance.model_summary)
    layout: dict[str, Any] = field(default_factory=dict)  # parallel group sizes of the latest attempt
    command_line: list[str] = field(default_factory=list)  # the latest attempt's argv, secrets scrubbed
    versions: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        """The description as text: totals, attempts, iteration spans, layers, layout, model, versions and drops."""
        lines = [
            f"run {self.run_id}: {self.records} records, {self.bytes / 2**20:.2f} MiB"
            + (f" ({self.superseded_records} superseded by later attempts)" if self.superseded_records else "")
        ]
        latest = self.attempts["attempt"].max() if not self.attempts.empty else None
        for _, a in self.attempts.iterrows():
            rf = a["resumed_from_iteration"]
            ended = (
                ""
                if a.get("ended", True)
                else (
                    ", died before it ended (no end-of-run report)"
                    if a["attempt"] != latest
                    else ", no end-of-run report yet (still running, or killed)"
                )
            )
            lines.append(
                f"  attempt {a['attempt']}: "
                + ("fresh start" if rf < 0 else f"resumed from iteration {rf}")
                + f", {a['world_size']} rank(s), started {a['started_at']}{ended}"
            )
        for phase, its in self.iterations.items():
            if its:
                lines.append(f"  {phase}: {len(its)} iteration(s) {its[0]}..{its[-1]}")
        lines.append(f"  layers: {format_ranges(self.layers)}")
        if self.layout:
            order = {k: i for i, k in enumerate(_LAYOUT_ORDER)}
            lines.append(
                "  layout: "
                + " ".join(f"{k}={v}" for k, v in sorted(self.layout.items(), key=lambda kv: order.get(kv[0], 99)))
            )
        if self.model:
            lines.append("  model: " + ", ".join(f"{k}={v}" for k, v in self.model.items() if k in _MODEL_HEADLINE))
        if self.versions:
            lines.append("  versions: " + ", ".join(f"{k} {v}" for k, v in sorted(self.versions.items())))
        if self.dropped_records:
            lines.append(f"  records dropped before persistence: {self.dropped_records}")
        return "\n".join(lines)


_LAYOUT_ORDER = ("world_size", "tp", "pp", "vpp", "cp", "ep", "etp", "dp")
# The model fields ``describe`` prints on one line (the full summary is in ``RunDescription.model``).
_MODEL_HEADLINE = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_moe_experts",
    "moe_router_topk",
    "moe_expert_capacity_factor",
    "moe_token_drop_policy",
    "moe_router_score_function",
    "params_dtype",
    "seq_length",
    "sequence_parallel",
)


def token_entropy(logits: np.ndarray) -> np.ndarray:
    """Entropy (nats) of softmax over the last axis of ``logits``, per token, in fp32 (as torch's softmax and
    entr compute it: 0 log 0 = 0)."""
    x = logits.astype(np.float32)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    p = e / e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p == 0, np.float32(0), -p * np.log(p))
    return terms.sum(axis=-1)


def resolve_store_dir(path: str) -> tuple[str, str]:
    """(store_dir, chdb_path) for a store directory, or for its ``chdb`` sub-folder."""
    path = os.path.abspath(path)
    if os.path.basename(path) == "chdb" and not os.path.isdir(os.path.join(path, "chdb")):
        return os.path.dirname(path), path
    return path, os.path.join(path, "chdb")


def find_stores(path: str, depth: int = 2) -> list[str]:
    """The DMI store folders (holding ``chdb/`` or ``spool/``) at most ``depth`` levels under ``path``, sorted."""
    found: list[str] = []
    try:
        entries = sorted(e for e in os.scandir(path) if e.is_dir() and not e.name.startswith("."))
    except OSError:
        return found
    for e in entries:
        if os.path.isdir(os.path.join(e.path, "chdb")) or os.path.isdir(os.path.join(e.path, "spool")):
            found.append(e.path)
        elif depth > 1:
            found += find_stores(e.path, depth - 1)
    return found


def check_store_dir(given: str, store_dir: str) -> None:
    """Raise NotAStoreError unless ``store_dir`` (the folder ``given`` names) is a store a reader can open: it
    exists, is a folder, and holds ``chdb/`` or ``spool/`` (a folder without them, such as a run's ``--save``
    folder or the parent of several stores, is named with the stores found under it)."""
    if os.path.isfile(store_dir):
        raise NotAStoreError(
            f"{given} is a file, not a DMI store: pass the store folder (--dmi-store-dir, default <--save>/dmi_store)"
        )
    if not os.path.isdir(store_dir):
        raise NotAStoreError(f"no DMI store at {given} (directory does not exist)", missing=True)
    if os.path.isdir(os.path.join(store_dir, "chdb")) or os.path.isdir(os.path.join(store_dir, "spool")):
        return
    found = find_stores(store_dir)
    if found:
        names = ", ".join(os.path.join(given, os.path.relpath(f, store_dir)) for f in found[:10])
        names += f" (and {len(found) - 10} more)" if found[10:] else ""
        raise NotAStoreError(f"{given} is not a DMI store (no chdb/ or spool/ in it); stores under it: {names}", found)
    raise NotAStoreError(
        f"{given} is not a DMI store (no chdb/ or spool/ in it, nor in its sub-folders): pass the folder given as "
        "--dmi-store-dir (default <--save>/dmi_store)"
    )


def open_store(
    path_or_url: str,
    *,
    database: str = S.DEFAULT_DATABASE,
    ingest: bool = True,
    password: str | None = None,
    progress: bool = False,
    writable: bool = False,
) -> Store:
    """Open a store.

    ``path_or_url``: a store directory (``--dmi-store-dir``: holds ``chdb/`` and ``spool/``) or a
    ClickHouse server URL. A directory is read through a snapshot taken now (see
    reader/snapshot.py, written under ``<store>/.readers/`` and removed on close), so this works
    while a training run writes the store and leaves the store's data and spool as they are; with
    ``ingest`` the snapshot also loads the spool's segments that the store does not
    hold yet (a live run's latest, a crash's leftovers, ``--dmi-persist spool``): the view shows
    every closed segment. ``writable=True`` opens the store itself instead (to ``load`` into it;
    chDB lets one process do that: StoreBusyError while a training run's ingester holds it). A
    server URL is read in place; its database gets the DMI tables if it lacks them. A path that is
    no store raises NotAStoreError (``check_store_dir``) before anything is created.
    """
    if _URL_RE.match(path_or_url):
        backend: Backend = ServerBackend(path_or_url, database, password)
        backend.ensure_schema()
        return Store(backend, path_or_url)
    store_dir, chdb_path = resolve_store_dir(path_or_url)
    if not writable:
        check_store_dir(path_or_url, store_dir)
    elif not os.path.isdir(store_dir):
        raise NotAStoreError(f"no DMI store at {path_or_url} (directory does not exist)", missing=True)
    if writable:
        backend = ChdbBackend(chdb_path, database)
        try:
            backend.ensure_schema()
        except BaseException:
            backend.close()
            raise
        return Store(backend, store_dir)
    snapshot = backend = None
    try:
        snapshot = ReaderSnapshot(store_dir)
        stats = SnapshotStats()
        spool = os.path.join(store_dir, "spool")
        if ingest and os.path.isdir(spool):  # first: a segment ingested meanwhile is then in the store copy
            link_spool(spool, snapshot.spool_root, stats)
        if os.path.isdir(chdb_path):
            link_store(chdb_path, snapshot.chdb_path, stats)
        backend = ChdbBackend(snapshot.chdb_path, database)
        backend.ensure_schema()
        result = IngestResult()
        if os.path.isdir(snapshot.spool_root):
            result = _ingest_with_progress(backend, snapshot.spool_root, delete=False, progress=progress)
            if result.segments_corrupt:
                warnings.warn(
                    f"DMI: {result.segments_corrupt} corrupt spool segment(s) skipped while reading "
                    f"{path_or_url}: " + "; ".join(result.errors[:3]),
                    RuntimeWarning,
                    stacklevel=2,
                )
    except BaseException as exc:
        if backend is not None:
            backend.close()
        if snapshot is not None:
            snapshot.close()
        if not out_of_space(exc):
            raise
        return _open_in_place(path_or_url, store_dir, chdb_path, database, exc)
    return Store(backend, store_dir, result, snapshot=snapshot, snapshot_stats=stats)


def _open_in_place(given: str, store_dir: str, chdb_path: str, database: str, why: BaseException) -> Store:
    """The store's disk has no room for a snapshot: a finished store (no process holds it) is read
    in place, with nothing loaded into it; otherwise DiskFullError, one line saying so."""
    from megatron.core.dmi.store.segments import list_segments

    full = f"the file system of {given} is full ({_first_line(why)})"
    if not os.path.isdir(chdb_path):
        raise DiskFullError(
            f"cannot read {given}: {full}, and its spool has to be loaded into a snapshot there to be read; "
            "free some space, or `megatron-dmi load` it into a store on another disk"
        ) from None
    try:
        backend = ChdbBackend(chdb_path, database)
    except StoreBusyError:
        raise DiskFullError(
            f"cannot read {given} while its run writes it: {full}, so no snapshot can be taken beside the "
            "run; free some space (or read it once the run has ended)"
        ) from None
    try:
        backend.ensure_schema()
    except BaseException as exc:
        backend.close()
        if out_of_space(exc):
            raise DiskFullError(f"cannot read {given}: {full}") from None
        raise
    waiting = sum(1 for seg in list_segments(os.path.join(store_dir, "spool")) if seg.kind == "tensors")
    if waiting:
        warnings.warn(
            f"DMI: {full}: read in place, without the {waiting} spool segment(s) not loaded into it yet; "
            "free some space and open it again to see them",
            RuntimeWarning,
            stacklevel=3,
        )
    return Store(backend, store_dir, read_only=True)


def _first_line(exc: BaseException) -> str:
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return (text.strip().splitlines() or [type(exc).__name__])[0][:200]


def _ingest_with_progress(backend: Backend, spool: str, delete: bool, progress: bool, streams: int = 1) -> IngestResult:
    from megatron.core.dmi.store.segments import list_segments

    segs = list_segments(spool)
    if not segs:
        return IngestResult()
    if not progress:
        return ingest_spool(backend, spool, delete=delete, streams=streams)
    from tqdm import tqdm

    total = sum(s.size for s in segs)
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading spool") as bar:
        return ingest_spool(backend, spool, delete=delete, streams=streams, progress=bar.update)


class Store:
    """``ingest_result``: spool segments loaded into this (snapshot) view when it opened;
    ``snapshot_stats``: what the snapshot linked (None for a store opened writable or a server)."""

    def __init__(
        self,
        backend: Backend,
        location: str,
        ingest_result: IngestResult | None = None,
        snapshot: ReaderSnapshot | None = None,
        snapshot_stats: SnapshotStats | None = None,
        read_only: bool = False,
    ):
        """A view of the store at ``location`` through ``backend``; ``snapshot`` is the reader snapshot it owns and
        removes at ``close``; ``read_only``: the store itself, opened for reading (its disk is full)."""
        self.backend = backend
        self.location = location
        self.ingest_result = ingest_result or IngestResult()
        self.snapshot_stats = snapshot_stats
        self._snapshot = snapshot
        self.read_only = read_only or snapshot is not None
        self._visible_cache: dict[str, dict[tuple[str, int], int]] = {}

    # -- plumbing ---------------------------------------------------------------------------
    @property
    def in_place(self) -> bool:
        """An embedded store read in place, without a snapshot (its file system had no room for one)."""
        return self.read_only and self._snapshot is None

    def __enter__(self) -> Store:
        """The store itself, closed when the ``with`` block ends."""
        return self

    def __exit__(self, *exc) -> None:
        """Close the store."""
        self.close()

    def close(self) -> None:
        """Close the backend, and remove the reader snapshot this store was opened on, if any."""
        self.backend.close()
        if self._snapshot is not None:
            self._snapshot.close()

    def t(self, table: str) -> str:
        """Qualified, validated name of ``table`` in the store's database."""
        return self.backend.t(table)

    def sql(self, query: str, params: dict[str, Any] | None = None) -> pa.Table:
        """Run any SQL (tables live in database ``dmi``; see docs/storage.md)."""
        return self.backend.query_arrow(query, params)

    def df(self, query: str, params: dict[str, Any] | None = None) -> pd.DataFrame:
        """Run SQL (as ``sql``) and return the result as a pandas DataFrame."""
        return self.sql(query, params).to_pandas()

    def load(
        self, spool_root: str, delete: bool = False, progress: bool = False, threads: int | None = None
    ) -> IngestResult:
        """Load spool segments from another directory (``--dmi-persist spool`` output) into a store
        opened with ``writable=True``, on ``threads`` threads (default: the ingester's, a quarter of the cores,
        1 to 4): the embedded store's chDB threads, or parallel inserts into a server. For the embedded store
        they stay the session's threads afterwards."""
        if self.read_only:
            raise StoreError(f"{self.location} is open for reading only: open it with writable=True to load")
        if threads is not None and threads < 1:
            raise InvalidArgumentError(f"threads must be >= 1, not {threads}")
        from megatron.core.dmi.store.ingester import default_ingest_threads

        streams = self.backend.use_threads(threads or default_ingest_threads())
        self._visible_cache.clear()
        return _ingest_with_progress(self.backend, spool_root, delete=delete, progress=progress, streams=streams)

    # -- runs -------------------------------------------------------------------------------
    def runs(self) -> pd.DataFrame:
        """One row per run: attempts, start time, visible record counts (what ``describe`` and every query see: the
        ``tensors_latest`` view), records superseded by later attempts, and the visible iteration span."""
        meta = self.df(
            f"SELECT run_id, max(attempt) AS attempts, min(started_at) AS started_at, max(world_size) AS world_size "
            f"FROM {self.t('runs')} FINAL GROUP BY run_id"
        )
        data = self.df(
            f"SELECT run_id, count() AS records, sum(nbytes) AS bytes, min(iteration) AS first_iteration, "
            f"max(iteration) AS last_iteration FROM {self.t('tensors_latest')} GROUP BY run_id"
        )
        total = self.df(f"SELECT run_id, count() AS stored FROM {self.t('tensors')} FINAL GROUP BY run_id")
        out = meta.merge(data, on="run_id", how="outer").merge(total, on="run_id", how="outer")
        out.insert(out.columns.get_loc("bytes"), "superseded", out["stored"].fillna(0) - out["records"].fillna(0))
        out = out.drop(columns=["stored"])
        for c in ("attempts", "world_size", "records", "superseded", "bytes", "first_iteration", "last_iteration"):
            out[c] = out[c].fillna(0).astype("int64")
        return out.sort_values(["started_at", "run_id"], na_position="first").reset_index(drop=True)

    def resolve_run(self, run_id: str | None) -> str:
        """``run_id`` itself, or the latest run when None."""
        return pick_run(list(self.runs()["run_id"]), run_id, self.location)

    def attempts(self, run_id: str) -> pd.DataFrame:
        """One row per attempt of ``run_id``: where it resumed from, start time, world size, the JSON of its config,
        model, layout and versions, and its command line."""
        return self.df(
            f"SELECT attempt, any(resumed_from_iteration) AS resumed_from_iteration, min(started_at) AS started_at, "
            f"max(world_size) AS world_size, any(versions_json) AS versions_json, any(config_json) AS config_json, "
            f"any(model_json) AS model_json, any(layout_json) AS layout_json, any(command_line) AS command_line "
            f"FROM {self.t('runs')} FINAL WHERE run_id = {{run:String}} GROUP BY attempt ORDER BY attempt",
            {"run": run_id},
        )

    def visible_attempts(self, run_id: str) -> dict[tuple[str, int], int]:
        """(phase, iteration) -> the attempt whose records a reader sees."""
        if run_id in self._visible_cache:
            return self._visible_cache[run_id]
        present = self.sql(
            f"SELECT DISTINCT phase, iteration, attempt FROM {self.t('tensors')} WHERE run_id = {{run:String}}",
            {"run": run_id},
        ).to_pylist()
        att = self.attempts(run_id)
        resumed = {int(a): int(r) for a, r in zip(att["attempt"], att["resumed_from_iteration"])}
        vis = visible_attempts(((p["phase"], int(p["iteration"]), int(p["attempt"])) for p in present), resumed)
        self._visible_cache[run_id] = vis
        return vis

    def _vis_params(self, run_id: str) -> dict[str, Any]:
        vis = self.visible_attempts(run_id)
        return {"run": run_id, "vis_keys": [f"{p}:{i}" for p, i in vis], "vis_attempts": list(vis.values())}

    def describe(self, run_id: str | None = None) -> RunDescription:
        """What the store holds of a run (the latest when ``run_id`` is None): visible records per phase and output,
        attempts, iterations, layers, superseded and dropped records, and the latest attempt's config, model,
        layout, versions and command line."""
        run_id = self.resolve_run(run_id)
        params = self._vis_params(run_id)
        outputs = self.df(
            f"SELECT phase, output, count() AS records, sum(nbytes) AS bytes, arraySort(groupUniqArray(layer)) AS layers, "
            f"uniqExact(iteration) AS n_iterations, min(iteration) AS first_iteration, max(iteration) AS last_iteration, "
            f"uniqExact(microbatch) AS microbatches, arraySort(groupUniqArray(rank)) AS ranks "
            f"FROM {self.t('tensors')} FINAL WHERE run_id = {{run:String}} AND {_VISIBLE} "
            f"GROUP BY phase, output ORDER BY phase, output",
            params,
        )
        superseded = (
            self.sql(
                f"SELECT count() AS n FROM {self.t('tensors')} FINAL WHERE run_id = {{run:String}} AND NOT ({_VISIBLE})",
                params,
            )
            .column("n")[0]
            .as_py()
        )
        drops = (
            self.sql(f"SELECT count() AS n FROM {self.t('drops')} FINAL WHERE run_id = {{run:String}}", {"run": run_id})
            .column("n")[0]
            .as_py()
        )
        attempts = self.attempts(run_id)
        reported = self.df(
            f"SELECT DISTINCT attempt FROM {self.t('reports')} FINAL WHERE run_id = {{run:String}}", {"run": run_id}
        )
        attempts["ended"] = attempts["attempt"].isin(reported["attempt"])  # a rank wrote its end-of-run report
        latest = attempts.iloc[-1] if not attempts.empty else None
        meta = {
            name: json_field(None if latest is None else latest[f"{name}_json"])
            for name in ("config", "model", "layout", "versions")
        }
        if meta["config"].get("run_id") is None and meta["config"]:
            meta["config"]["run_id"] = run_id  # the config holds what was asked for; the id was generated
        vis = self.visible_attempts(run_id)
        iterations: dict[str, list[int]] = defaultdict(list)
        for phase, it in sorted(vis):
            iterations[phase].append(it)
        layers = sorted({int(x) for ls in outputs["layers"] for x in ls}) if not outputs.empty else []
        return RunDescription(
            run_id=run_id,
            attempts=attempts.drop(columns=["config_json", "model_json", "layout_json", "command_line"]),
            outputs=outputs,
            layers=layers,
            iterations=dict(iterations),
            records=int(outputs["records"].sum()) if not outputs.empty else 0,
            bytes=int(outputs["bytes"].sum()) if not outputs.empty else 0,
            superseded_records=int(superseded),
            dropped_records=int(drops),
            **meta,
            command_line=[] if latest is None or latest["command_line"] is None else list(latest["command_line"]),
        )

    def topology(self, run_id: str, attempt: int | None = None) -> pd.DataFrame:
        """The topology rows (one per rank) of one attempt of ``run_id``, the latest when ``attempt`` is None."""
        if attempt is None:
            attempt = int(self.attempts(run_id)["attempt"].max()) if not self.attempts(run_id).empty else 0
        return self.df(
            f"SELECT * FROM {self.t('topology')} FINAL WHERE run_id = {{run:String}} AND attempt = {{a:Int32}} "
            f"ORDER BY rank",
            {"run": run_id, "a": int(attempt)},
        )

    def dropped_records(self, run_id: str | None = None) -> pd.DataFrame:
        """Records lost before persistence (ring full, disk full), with their keys and reason."""
        run_id = self.resolve_run(run_id)
        return self.df(
            f"SELECT * FROM {self.t('drops')} FINAL WHERE run_id = {{run:String}} "
            f"ORDER BY attempt, iteration, microbatch, layer, output, rank",
            {"run": run_id},
        )

    def reports(self, run_id: str | None = None) -> pd.DataFrame:
        """The end-of-run sink reports of a run (the latest when ``run_id`` is None), by attempt and rank."""
        run_id = self.resolve_run(run_id)
        return self.df(
            f"SELECT * FROM {self.t('reports')} FINAL WHERE run_id = {{run:String}} ORDER BY attempt, rank",
            {"run": run_id},
        )

    # -- tensors ----------------------------------------------------------------------------
    @selecting
    def records(self, sel: TensorSelection) -> list[Record]:
        """The stored shards of one tensor (checksums verified), from the visible attempt; ``dp=None``:
        those of every data-parallel rank."""
        run_id, output, iteration, phase, layer = sel.run_id, sel.output, sel.iteration, sel.phase, sel.layer
        attempt = visible_attempt(self.visible_attempts(run_id), run_id, phase, iteration)
        params = {
            "run": run_id,
            "phase": phase,
            "output": output,
            "it": int(iteration),
            "mb": int(sel.microbatch),
            "inv": int(sel.invocation),
            "att": int(attempt),
        }
        where = (
            "run_id = {run:String} AND phase = {phase:String} AND output = {output:String} AND iteration = {it:Int64} "
            "AND microbatch = {mb:Int32} AND invocation = {inv:Int8} AND attempt = {att:Int32}"
        )
        if sel.dp is not None:
            params["dp"] = int(sel.dp)
            where += " AND dp = {dp:Int32}"
        if layer is None:
            layers = (
                self.sql(f"SELECT DISTINCT layer FROM {self.t('tensors')} WHERE {where} ORDER BY layer", params)
                .column("layer")
                .to_pylist()
            )
            if not layers:
                self._raise_no_records(run_id, output, phase, iteration, None)
                return []
            if len(layers) != 1:
                raise AmbiguousLayerError(output, iteration, format_ranges(layers))
            layer = layers[0]
        params["layer"] = int(layer)
        table = self.sql(
            f"SELECT {_RECORD_SELECT} FROM {self.t('tensors')} FINAL WHERE {where} AND layer = {{layer:Int32}}", params
        )
        return records_from_table(table)

    def _raise_no_records(self, run_id: str, output: str, phase: str, iteration: int, layer: int | None) -> None:
        """Raise a StoreError naming what a query for no records got wrong: an output the run did not capture
        (the captured ones, the nearest name), or a layer it was not captured at; return when neither."""
        import difflib

        where = (
            "run_id = {run:String} AND phase = {phase:String} AND output = {output:String} AND iteration = {it:Int64}"
        )
        params = {"run": run_id, "phase": phase, "output": output, "it": int(iteration)}
        outputs = self.sql(
            f"SELECT DISTINCT output FROM {self.t('tensors')} WHERE run_id = {{run:String}} ORDER BY output", params
        ).column("output")
        captured = [str(o) for o in outputs.to_pylist()]
        if output not in captured:
            known = "unknown output" if output not in catalog.BY_NAME else "output"
            near = difflib.get_close_matches(output, captured or list(catalog.BY_NAME), n=1)
            raise StoreError(
                f"{known} {output!r}: run {run_id!r} captured "
                + (", ".join(captured) or "nothing")
                + (f"; did you mean {near[0]!r}?" if near else "")
            )
        layers = self.sql(f"SELECT DISTINCT layer FROM {self.t('tensors')} WHERE {where} ORDER BY layer", params)
        got = layers.column("layer").to_pylist()
        if layer is not None and got and layer not in got:
            raise StoreError(
                f"{output} at iteration {iteration} was captured at layer(s) {format_ranges(got)}, not at layer {layer}"
            )

    @selecting
    def tensor(self, sel: TensorSelection) -> torch.Tensor:
        """The full tensor rebuilt from every TP/SP/EP/CP/PP shard (see reconstruct.py for the rules), in torch,
        bitwise as stored. Raises ReconstructionError on a gap, an overlap or conflicting duplicates."""
        return self._rebuild(sel).torch()

    @selecting
    def array(self, sel: TensorSelection) -> np.ndarray:
        """``tensor``'s values as a numpy array, without importing torch (bfloat16 widened exactly to float32)."""
        return self._rebuild(sel).values

    @selecting
    def rebuild(self, sel: TensorSelection) -> Rebuilt:
        """``tensor`` without torch: the stored dtype's name and the values (``Rebuilt``)."""
        return self._rebuild(sel)

    def _rebuild(self, sel: TensorSelection) -> Rebuilt:
        sel.check_one_rank()
        spec = catalog.BY_NAME.get(sel.output)
        rows = spec is not None and spec.combine == "rows"
        # an expert group's ranks hold each other's tokens' rows: read every data-parallel rank's records
        recs = self.records(replace(sel, dp=None) if rows else sel)
        layer = recs[0].key.layer if recs else sel.layer
        what = sel.what(layer)
        if not recs:
            self._raise_no_records(sel.run_id, sel.output, sel.phase, sel.iteration, sel.layer)
            raise sel.no_records(layer)
        if rows:
            topo = self.topology(sel.run_id, recs[0].key.attempt)
            sources = {int(r["rank"]): (int(r["dp"]), int(r["tp"])) for _, r in topo.iterrows()}
            return Rebuilt("float32", rebuild_expert_rows(recs, sources, sel.dp, what))
        return rebuild(recs, sel.output, what=what, expected_ranks=self._expected_ranks(sel.run_id, recs))

    def rebuild_each(
        self, run_id: str, output: str, phase: str = "train", invocation: int = 0
    ) -> dict[tuple[int, int, int, int], Rebuilt]:
        """Every visible tensor of ``output`` in ``phase``, rebuilt without torch, by (iteration, microbatch,
        layer, data-parallel rank), from one query (``rebuild`` queries the store several times per tensor)."""
        spec = catalog.BY_NAME.get(output)
        if spec is not None and spec.combine == "rows":
            raise StoreError(f"{output} rebuilds one data-parallel rank at a time from every rank: use rebuild()")
        table = self.sql(
            f"SELECT {_RECORD_SELECT} FROM {self.t('tensors')} FINAL WHERE run_id = {{run:String}}"
            f" AND phase = {{phase:String}} AND output = {{output:String}} AND invocation = {{inv:Int8}} AND {_VISIBLE}",
            {**self._vis_params(run_id), "phase": phase, "output": output, "inv": int(invocation)},
        )
        return rebuild_each(records_from_table(table), output, what=f"{output} run {run_id} {phase}")

    def _expected_ranks(self, run_id: str, recs: list[Record]) -> dict[int, list[int]] | None:
        """Shard index -> ranks holding this layer with that TP coordinate (for error messages)."""
        k = recs[0].key
        try:
            topo = self.topology(run_id, k.attempt)
        except Exception:  # last resort: these ranks only name suspects in a ReconstructionError's
            return None  # message; a store that cannot tell them must not replace that error
        return expected_ranks(topo.to_dict("records"), k)

    # -- questions --------------------------------------------------------------------------
    def expert_load(
        self,
        run_id: str | None = None,
        phase: str = "train",
        layers: Sequence[int] | None = None,
        iterations: Sequence[int] | None = None,
    ) -> pd.DataFrame:
        """Tokens per expert per layer per iteration, before (``tokens_pre``) and after
        (``tokens_post``) capacity dropping, summed over microbatches and data-parallel ranks
        (replicated producers counted once). From the ``expert_counts`` summary table: no payloads
        are decoded."""
        run_id = self.resolve_run(run_id)
        params = self._vis_params(run_id)
        params.update(phase=phase, layers=[int(x) for x in layers or []], its=[int(x) for x in iterations or []])
        return self.df(
            f"SELECT iteration, layer, expert, sum(pre) AS tokens_pre, sum(post) AS tokens_post FROM ("
            f" SELECT iteration, microbatch, layer, dp, token_start, token_end, expert, any(tokens_pre) AS pre,"
            f" any(tokens_post) AS post FROM {self.t('expert_counts')} FINAL"
            f" WHERE run_id = {{run:String}} AND phase = {{phase:String}} AND invocation = 0 AND {_VISIBLE}"
            f" AND (empty({{layers:Array(Int32)}}) OR has({{layers:Array(Int32)}}, layer))"
            f" AND (empty({{its:Array(Int64)}}) OR has({{its:Array(Int64)}}, iteration))"
            f" GROUP BY iteration, microbatch, layer, dp, token_start, token_end, expert)"
            f" GROUP BY iteration, layer, expert ORDER BY iteration, layer, expert",
            params,
        )

    def expert_count_parts(self, run_id: str, phase: str = "train") -> dict[int, int]:
        """Visible iteration -> how many ``router.expert_counts`` parts (microbatch x layer x data-parallel rank x
        token range) it holds: an iteration with fewer than the fullest one is partial (a live run's newest, or
        one a killed attempt left half written)."""
        params = self._vis_params(run_id)
        params["phase"] = phase
        rows = self.sql(
            f"SELECT iteration, uniqExact(microbatch, layer, dp, token_start, token_end) AS parts "
            f"FROM {self.t('expert_counts')} FINAL WHERE run_id = {{run:String}} AND phase = {{phase:String}} "
            f"AND invocation = 0 AND {_VISIBLE} GROUP BY iteration ORDER BY iteration",
            params,
        ).to_pylist()
        return {int(r["iteration"]): int(r["parts"]) for r in rows}

    def latest_complete_iteration(self, run_id: str, phase: str = "train") -> int | None:
        """The newest visible iteration with as many ``router.expert_counts`` parts as the fullest one (None: no
        counts): the newest iteration may be only partly written, and its numbers would look like a collapse."""
        parts = self.expert_count_parts(run_id, phase)
        if not parts:
            return None
        fullest = max(parts.values())
        return max(it for it, n in parts.items() if n == fullest)

    def drop_rate(self, run_id: str | None = None, phase: str = "train", by_layer: bool = False) -> pd.DataFrame:
        """Fraction of routed token slots dropped by the capacity factor, per iteration (and layer).
        ``complete`` is False where ``router.expert_counts`` records of that iteration were lost
        before persistence (``--dmi-on-full drop``): the rate then covers only the tokens that
        arrived; an iteration with none left has a row of zeros."""
        run_id = self.resolve_run(run_id)
        load = self.expert_load(run_id, phase)
        keys = ["iteration", "layer"] if by_layer else ["iteration"]
        lost = self.df(
            f"SELECT DISTINCT iteration, layer FROM {self.t('drops')} FINAL WHERE run_id = {{run:String}} "
            f"AND phase = {{phase:String}} AND output = 'router.expert_counts' AND invocation = 0",
            {"run": run_id, "phase": phase},
        )
        if load.empty and lost.empty:
            return pd.DataFrame(columns=keys + ["tokens_pre", "tokens_post", "drop_rate", "complete"])
        g = load.groupby(keys, as_index=False)[["tokens_pre", "tokens_post"]].sum()
        lost_keys = lost[keys].drop_duplicates()
        g = g.merge(lost_keys.assign(complete=False), on=keys, how="outer")
        g["complete"] = g["complete"].isna()
        g[["tokens_pre", "tokens_post"]] = g[["tokens_pre", "tokens_post"]].fillna(0).astype("int64")
        g["drop_rate"] = (g["tokens_pre"] - g["tokens_post"]) / g["tokens_pre"].where(g["tokens_pre"] > 0)
        g["drop_rate"] = g["drop_rate"].fillna(0.0)
        return g.sort_values(keys).reset_index(drop=True)[keys + ["tokens_pre", "tokens_post", "drop_rate", "complete"]]

    def router_entropy(
        self,
        run_id: str | None = None,
        phase: str = "train",
        layers: Sequence[int] | None = None,
        iterations: Sequence[int] | None = None,
        dp: int = 0,
        progress: bool = False,
    ) -> pd.DataFrame:
        """Mean per-token entropy (nats) of the routing distribution softmax(router.logits), per
        iteration and layer (tokens of all microbatches of data-parallel rank ``dp``);
        ``entropy_normalized`` divides by log(E) (1 = uniform routing)."""
        run_id = self.resolve_run(run_id)
        vis = self.visible_attempts(run_id)
        its = sorted(i for p, i in vis if p == phase and (not iterations or i in set(iterations)))
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(its), desc="router entropy", unit="it")
        rows = []
        for it in its:
            params = {
                "run": run_id,
                "phase": phase,
                "it": it,
                "att": vis[(phase, it)],
                "dp": int(dp),
                "layers": [int(x) for x in layers or []],
            }
            table = self.sql(
                f"SELECT {_RECORD_SELECT} FROM {self.t('tensors')} FINAL WHERE run_id = {{run:String}} AND phase = {{phase:String}}"
                f" AND output = 'router.logits' AND iteration = {{it:Int64}} AND attempt = {{att:Int32}} AND dp = {{dp:Int32}}"
                f" AND invocation = 0 AND (empty({{layers:Array(Int32)}}) OR has({{layers:Array(Int32)}}, layer))",
                params,
            )
            groups: dict[tuple[int, int], list[Record]] = defaultdict(list)
            for r in records_from_table(table):
                groups[(r.key.layer, r.key.microbatch)].append(r)
            per_layer: dict[int, list[float]] = defaultdict(lambda: [0.0, 0, 0])
            for (layer, mb), recs in sorted(groups.items()):
                logits = rebuild(
                    recs, "router.logits", what=f"router.logits iteration {it} microbatch {mb} layer {layer}"
                ).values
                if logits.size == 0:
                    continue
                h = token_entropy(logits)
                acc = per_layer[layer]
                acc[0] += float(h.sum())
                acc[1] += h.size
                acc[2] = logits.shape[-1]
            for layer, (hsum, n, e) in sorted(per_layer.items()):
                ent = hsum / n
                rows.append(
                    {
                        "iteration": it,
                        "layer": layer,
                        "entropy": ent,
                        "entropy_normalized": ent / math.log(e) if e > 1 else 0.0,
                        "tokens": n,
                    }
                )
            if bar:
                bar.update(1)
        if bar:
            bar.close()
        return pd.DataFrame(rows, columns=["iteration", "layer", "entropy", "entropy_normalized", "tokens"])

    def attention_pattern(
        self,
        run_id: str,
        iteration: int,
        microbatch: int,
        layer: int,
        head: int,
        batch: int = 0,
        phase: str = "train",
        dp: int = 0,
    ) -> torch.Tensor:
        """[s, s] causal attention probabilities of one head, rebuilt from attn.q and attn.k
        (softmax(q k^T / sqrt(d)) with future positions masked; under GQA head h reads key group
        h // (heads / groups))."""
        q = self.tensor(run_id, "attn.q", iteration, microbatch, layer, phase, dp)
        k = self.tensor(run_id, "attn.k", iteration, microbatch, layer, phase, dp)
        if q.dim() != 4 or k.dim() != 4:
            raise StoreError(f"attn.q/attn.k must be [s, b, heads, d]; got {list(q.shape)} and {list(k.shape)}")
        s, b, heads, d = q.shape
        groups = k.shape[2]
        if not 0 <= head < heads:
            raise StoreError(f"head {head} outside 0..{heads - 1}")
        if not 0 <= batch < b:
            raise StoreError(f"batch {batch} outside 0..{b - 1}")
        if heads % groups:
            raise StoreError(f"{heads} query heads do not divide into {groups} key groups")
        import torch

        g = head // (heads // groups)
        qh = q[:, batch, head].double()
        kh = k[:, batch, g].double()
        scores = qh @ kh.T / math.sqrt(d)
        mask = torch.ones(s, kh.shape[0], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        return torch.softmax(scores, dim=-1).float()
