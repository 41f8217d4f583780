"""Export: a store's rows written back out as spool segments, e.g. to merge node-local stores
into one (export each, then ``load`` them all into one store). It writes spool files, so it lives
with the spool writers, not in the reader: the reader only reads."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron.core.dmi.records import TENSOR_SCHEMA
from megatron.core.dmi.sinks.spool import SpoolWriter
from megatron.core.dmi.store import schema as S

if TYPE_CHECKING:
    from megatron.core.dmi.reader.store import Store


def export_spool(
    store: Store, out_dir: str, run_id: str | None = None, max_segment_bytes: int = 256 << 20, progress: bool = False
) -> int:
    """Write a store's rows back out as spool segments under ``out_dir`` (``rank-*`` folders),
    e.g. to merge node-local stores into one: export each, then ``load`` them all into one store.
    Returns the number of tensor records exported."""
    where, params = ("WHERE run_id = {run:String}", {"run": run_id}) if run_id else ("", {})
    writers: dict[int, SpoolWriter] = {}

    def writer(rank: int) -> SpoolWriter:
        if rank not in writers:
            writers[rank] = SpoolWriter(out_dir, rank, run_id or "")
        return writers[rank]

    for kind in ("runs", "topology", "drops", "reports"):
        schema = S.KIND_SCHEMAS[kind]
        t = store.sql(f"SELECT {', '.join(schema.names)} FROM {store.t(kind)} FINAL {where}", params)
        if t.num_rows:
            writer(int(min(t.column("rank").to_pylist()))).write(kind, t.cast(schema))
    sizes = store.sql(
        f"SELECT rank, iteration, sum(nbytes) AS b FROM {store.t('tensors')} FINAL {where} "
        f"GROUP BY rank, iteration ORDER BY rank, iteration",
        params,
    ).to_pylist()
    chunks: list[tuple[int, list[int]]] = []
    acc = 0
    for row in sizes:
        if not chunks or chunks[-1][0] != row["rank"] or acc + row["b"] > max_segment_bytes:
            chunks.append((row["rank"], []))
            acc = 0
        chunks[-1][1].append(int(row["iteration"]))
        acc += int(row["b"])
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(chunks), desc="export", unit="segment")
    n = 0
    cond = "rank = {rank:Int32} AND has({its:Array(Int64)}, iteration)" + (
        " AND run_id = {run:String}" if run_id else ""
    )
    for rank, its in chunks:
        t = store.sql(
            f"SELECT {', '.join(TENSOR_SCHEMA.names)} FROM {store.t('tensors')} FINAL WHERE {cond}",
            dict(params, rank=rank, its=its),
        )
        writer(rank).write("tensors", t.cast(TENSOR_SCHEMA))
        n += t.num_rows
        if bar:
            bar.update(1)
    if bar:
        bar.close()
    return n
