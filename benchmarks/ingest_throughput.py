"""How fast one chDB session takes record payloads, and where the real ingest pass spends its time (issue 33).

**Store sweep** (always): each measurement creates a fresh embedded store with one table ``(k UInt64,
payload String CODEC(<codec>))`` and inserts ``--total-mb`` of bf16 payloads (normal samples, like
activations; barely compressible) in ``--batch-mb`` Arrow batches, for every combination of

- ``--codecs``: the payload codec (``ZSTD(1)``, ``LZ4``, ``NONE``);
- ``--record-mb``: the record size (32 MiB: ``attn.context`` at the benchmark's scale);
- ``--batch-mb``: payload per INSERT (the ingester's ``max_batch_bytes``);
- ``--paths``: how a batch gets in: ``python`` (``INSERT ... SELECT FROM Python(batch)``, the whole batch
  one stream: the embedded backend's statement before issue 33), ``streams`` (the statement the embedded
  backend's ``insert_arrow`` runs now: ``Python()`` over the batch cut into ``--parallel`` record batches,
  with the settings of ``store.backend.insert_streams``: ``max_threads`` = ``max_insert_threads`` = streams
  and squashing only of small blocks, so each stream converts, sorts, compresses and writes its own part),
  ``file`` (the same cut, each piece written by pyarrow as an Arrow IPC file into a scratch folder beside
  the store, then ``INSERT ... SELECT FROM file('<scratch>/batch_*.arrow', 'Arrow')`` with the same
  settings: ClickHouse's own reader, no Python at all; the files' writing is timed too, ``write_s``),
  ``arrow`` (``INSERT ... FORMAT ArrowStream`` through ``send_insert``, the batch serialised to Arrow IPC;
  the full ``chdb`` package only), ``union`` (one INSERT of ``--parallel`` slices of the batch,
  ``SELECT FROM Python(slice) UNION ALL ...`` with ``max_insert_threads`` = slices);
- ``--parallel``: for ``streams``, ``file`` and ``union``, the streams (slices) of one statement; for
  ``python`` and ``arrow``, that many Python threads insert batches into the one session at the same time
  (does chDB run concurrent inserts of one session side by side?);
- ``--engines``: ``MergeTree`` or ``ReplacingMergeTree`` (the store's engine: ``optimize_on_insert``
  deduplicates each inserted block on it);
- ``--order``: ``sorted`` (rows arrive in sort-key order) or ``shuffled`` (each batch's keys permuted:
  the insert's sort gathers the payloads into the new order);
- ``--insert-settings``: extra settings of every INSERT, e.g. ``optimize_on_insert=1``, several joined by
  ``,`` (``-`` for none);
- ``--merges``: ``on`` (background merges run, as in a store) or ``off`` (``SYSTEM STOP MERGES`` on
  the table: the insert alone).

It reports GiB/s of payload, the CPU cores the process used meanwhile (process CPU time over wall
time: more than 1 means the engine ran the work on several cores), the CPU seconds of the busiest
threads (``thread_cpu_s``: on a loaded machine the wall time says little, but work split evenly over
threads is work that more cores run side by side), the parts left and the compression ratio the store
reached (``system.columns``).

**Ingest pass** (``--ingest``): the product's path end to end. For each ``--ingest-record-kb``,
``--ingest-formats`` and ``--ingest-codecs``, ``--total-mb`` of records are spooled (not timed) into
segments of ``--ingest-segment-mb``: ``raw`` ones by the JIT-built native ring on the host and its
drain, as a training writes them, or ``parquet`` ones by a ``SpoolSink`` (the Python transport's); then ``ingest_spool`` loads them into a fresh store of the real
schema (``ensure_schema(payload_codec=...)``) with ``max_batch_bytes`` = ``--ingest-batch-mb``: GiB/s
of payload, the pass's seconds by stage (``IngestResult.seconds``: verify = waiting for segments to be
read and every CRC checked, insert, read_back, record) and the read-back's share of the pass (the
ingester's budget: <= 5 %). ``--ingest-streams``: the ingester's chDB threads, which are also the
streams of each insert (``ChdbBackend.use_threads``, ``--dmi-ingest-threads``); ``--ingest-merges off``
stops the store's background merges (the pass alone). ``--read-ahead off``
leaves the pass's reading threads idle, so each segment is verified in turn (as before they existed). It
also times verifying every segment on one thread alone (``verify_alone_s``, the "alone" column).

    python benchmarks/ingest_throughput.py --codecs 'ZSTD(1)' LZ4 NONE --record-mb 32 --batch-mb 64 256 \
        --paths python streams file arrow union --parallel 1 2 4 --merges on off --total-mb 1024 \
        --ingest --ingest-record-kb 32768 128 --ingest-streams 1 2 4 --ingest-formats raw parquet --ingest-merges on off --read-ahead on off \
        --json benchmarks/results/ingest_throughput_<host>.json

``--quick`` is a smoke run of every path with small sizes (seconds; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import resource
import shutil
import subprocess
import tempfile
import threading
import time

import numpy as np
import pyarrow as pa
from chdb import session as chs
from results_json import write_json  # benchmarks/ is the script directory

from megatron.core.dmi.store.backend import insert_streams


def bf16_payload(nbytes: int, rng: np.random.Generator) -> bytes:
    """``nbytes`` of bfloat16 normal samples (the top half of float32's bits)."""
    x = rng.standard_normal(nbytes // 2, dtype=np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def cpu_seconds() -> float:
    """CPU time of this process so far, every thread (chDB's included)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def load_average() -> float:
    """The machine's 1-minute load average (it is shared: the figures depend on it)."""
    return os.getloadavg()[0]


_TICKS = os.sysconf("SC_CLK_TCK")


def thread_cpu() -> dict[int, float]:
    """CPU seconds of each thread of this process so far (``/proc/self/task``)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / _TICKS
    return out


def busiest_threads(before: dict[int, float], after: dict[int, float], top: int = 4) -> list[float]:
    """CPU seconds of the ``top`` busiest threads between two ``thread_cpu`` readings."""
    spent = sorted((cpu - before.get(tid, 0.0) for tid, cpu in after.items()), reverse=True)
    return [round(s, 2) for s in spent[:top]]


def make_batches(
    record_mb: float, total_mb: float, batch_mb: float, seed: int, order: str = "sorted"
) -> tuple[list[pa.Table], int]:
    """Arrow batches ``(k, payload)`` of ``total_mb`` of bf16 payloads, and the payload bytes in them; with
    ``order="shuffled"`` each batch's keys are permuted (rows arrive out of sort-key order)."""
    rng = np.random.default_rng(seed)
    nbytes = max(2, int(record_mb * 2**20) // 2 * 2)
    pool = [bf16_payload(nbytes, rng) for _ in range(8)]  # distinct payloads: no repeats within a block
    n = max(1, int(total_mb * 2**20 / nbytes))
    per_batch = max(1, int(batch_mb * 2**20 / nbytes))
    batches = []
    for lo in range(0, n, per_batch):
        keys = np.arange(lo, min(n, lo + per_batch), dtype=np.uint64)
        if order == "shuffled":
            keys = rng.permutation(keys)
        payloads = pa.array([pool[i % len(pool)] for i in range(lo, min(n, lo + per_batch))], type=pa.binary())
        batches.append(pa.table({"k": pa.array(keys), "payload": payloads}))
    return batches, n * nbytes


def settings_clause(settings: dict[str, int], extra: str) -> str:
    """`` SETTINGS ...`` of ``settings`` and then ``extra`` (``k=v,k=v``; they win), or nothing."""
    merged = {k: str(v) for k, v in settings.items()}
    for item in filter(None, extra.split(",")):
        k, _, v = item.partition("=")
        merged[k.strip()] = v.strip()
    return (" SETTINGS " + ", ".join(f"{k} = {v}" for k, v in merged.items())) if merged else ""


def _insert_python(session, batch: pa.Table, extra: str) -> None:
    arrow_rows = batch  # noqa: F841 (read by name by the query)
    session.query("INSERT INTO bench.t SELECT k, payload FROM Python(arrow_rows)" + settings_clause({}, extra))


def _insert_streams(session, batch: pa.Table, streams: int, extra: str) -> None:
    arrow_rows, settings = insert_streams(batch, streams)  # noqa: F841 (read by name by the query)
    session.query("INSERT INTO bench.t SELECT k, payload FROM Python(arrow_rows)" + settings_clause(settings, extra))


def _insert_file(session, batch: pa.Table, streams: int, extra: str, scratch: str, timings: dict) -> None:
    """One piece per stream written as an Arrow IPC file, read by ClickHouse's ``file()``, then deleted."""
    t0 = time.perf_counter()
    pieces, settings = insert_streams(batch, streams)
    names = []
    for i, rb in enumerate(pieces.to_batches()):
        names.append(os.path.join(scratch, f"batch_{i}.arrow"))
        with pa.ipc.new_file(names[-1], rb.schema) as w:
            w.write_batch(rb)
    timings["write_s"] = timings.get("write_s", 0.0) + time.perf_counter() - t0
    try:
        session.query(
            f"INSERT INTO bench.t SELECT k, payload FROM file('{scratch}/batch_*.arrow', 'Arrow')"
            + settings_clause(settings, extra)
        )
    finally:
        for name in names:
            os.unlink(name)


def _insert_arrow(session, batch: pa.Table, extra: str) -> None:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_table(batch)
    with session.send_insert("INSERT INTO bench.t (k, payload)" + settings_clause({}, extra), "ArrowStream") as ins:
        ins.append(sink.getvalue().to_pybytes())
        ins.finish()


def _insert_union(session, batch: pa.Table, slices: int, extra: str) -> None:
    step = -(-batch.num_rows // slices)
    parts = [batch.slice(lo, step) for lo in range(0, batch.num_rows, step)]
    frame = {f"arrow_slice_{i}": p for i, p in enumerate(parts)}  # read by name by the query
    union = " UNION ALL ".join(f"SELECT k, payload FROM Python(arrow_slice_{i})" for i in range(len(parts)))
    sql = f"INSERT INTO bench.t {union}" + settings_clause({"max_insert_threads": len(parts)}, extra)
    _run_with_names(session, sql, frame)


def _run_with_names(session, sql: str, names: dict) -> None:
    """Run ``sql`` from a frame whose locals hold ``names`` (chDB's Python() finds tables by name there)."""
    code = compile("session.query(sql)", "<union insert>", "exec")
    exec(code, {"session": session, "sql": sql}, dict(names))


def measure_store(
    root: str,
    codec: str,
    record_mb: float,
    batch_mb: float,
    path: str,
    parallel: int,
    merges: str,
    total_mb: float,
    seed: int,
    engine: str = "MergeTree",
    order: str = "sorted",
    extra: str = "",
) -> dict:
    """One fresh store, one combination: GiB/s of payload inserted, cores used, parts and ratio."""
    batches, payload = make_batches(record_mb, total_mb, batch_mb, seed, order)
    where = tempfile.mkdtemp(dir=root)
    scratch = os.path.join(where, "scratch")  # the file path's Arrow files: beside the store, same file system
    os.makedirs(scratch)
    session = chs.Session(os.path.join(where, "chdb"))
    load = load_average()
    timings: dict[str, float] = {}
    try:
        session.query("CREATE DATABASE IF NOT EXISTS bench")
        session.query(f"CREATE TABLE bench.t (k UInt64, payload String CODEC({codec})) ENGINE = {engine} ORDER BY k")
        if merges == "off":
            session.query("SYSTEM STOP MERGES bench.t")
        if path == "union":
            work, threads = (lambda b: _insert_union(session, b, parallel, extra)), 1
        elif path == "streams":
            work, threads = (lambda b: _insert_streams(session, b, parallel, extra)), 1
        elif path == "file":
            work, threads = (lambda b: _insert_file(session, b, parallel, extra, scratch, timings)), 1
        else:
            one = _insert_python if path == "python" else _insert_arrow
            work, threads = (lambda b: one(session, b, extra)), parallel
        queue, lock, errors = iter(batches), threading.Lock(), []

        def worker() -> None:
            while True:
                with lock:
                    b = next(queue, None)
                if b is None:
                    return
                try:
                    work(b)
                except Exception as e:  # reported in the results: a path chDB refuses is a finding
                    errors.append(f"{type(e).__name__}: {e}")
                    return

        per_thread, c0, t0 = thread_cpu(), cpu_seconds(), time.perf_counter()
        pool = [threading.Thread(target=worker) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        busiest = busiest_threads(per_thread, thread_cpu())
        stats = str(
            session.query(
                "SELECT (SELECT count() FROM bench.t), (SELECT count() FROM system.parts WHERE database = 'bench' "
                "AND table = 't' AND active), sum(data_compressed_bytes), sum(data_uncompressed_bytes) "
                "FROM system.columns WHERE database = 'bench' AND table = 't' AND name = 'payload'",
                "CSV",
            )
        ).strip()
        rows, parts, compressed, uncompressed = (int(v) for v in stats.split(","))
    finally:
        session.close()
        shutil.rmtree(where, ignore_errors=True)
    expected = sum(b.num_rows for b in batches)
    return {
        "codec": codec,
        "record_mb": record_mb,
        "batch_mb": batch_mb,
        "path": path,
        "parallel": parallel,
        "engine": engine,
        "order": order,
        "settings": extra,
        "merges": merges,
        "payload_mb": payload / 2**20,
        "GiBps": payload / 2**30 / wall,
        "cores_used": cpu / wall,
        "cpu_s_per_GiB": cpu / (payload / 2**30),
        "thread_cpu_s": busiest,
        "write_s": timings.get("write_s"),
        "parts": parts,
        "rows_ok": rows == expected,
        "ratio": uncompressed / compressed if compressed else None,  # None: compact parts keep no column sizes
        "load_before": load,
        "errors": errors[:1],
    }


def spool_raw(sink, size: int, per_segment: int, n_segments: int, pool: list[bytes]) -> None:
    """The training's path to the spool: ``make_records``' records published into the JIT-built native ring on the
    host, its drain writing them as raw ``.dmiraw`` segments of ``per_segment`` records (closed by a flush)."""
    import torch
    from persist_throughput import make_records

    from megatron.core.dmi.config import DMIConfig
    from megatron.core.dmi.drain import Drain
    from megatron.core.dmi.transport.native import NativeRingTransport

    ring = NativeRingTransport(max(64 << 20, 4 * size), "block", "cpu", block_timeout=DMIConfig.block_timeout)
    drain = Drain(ring, sink, linger_bytes=0)
    if not drain.native:
        raise SystemExit("the native ring's spool writer is not available here (megatron-dmi doctor --build says why)")
    for it in range(n_segments):
        for r in make_records(size, per_segment, it + 1, pool):
            x = torch.frombuffer(bytearray(r.payload), dtype=torch.bfloat16).view(r.key.shape)
            ring.publish(r.key, x)
        drain.flush()  # closes the segment
    drain.close()
    ring.close()
    written = sink.close().records_written
    if written != per_segment * n_segments:
        raise SystemExit(f"the native ring wrote {written} of {per_segment * n_segments} records")


def measure_ingest(
    root: str,
    codec: str,
    record_kb: float,
    total_mb: float,
    segment_mb: float,
    batch_mb: float,
    read_ahead: str,
    streams: int = 1,
    merges: str = "on",
    segment_format: str = "raw",
) -> dict:
    """Spool ``total_mb`` of ``record_kb`` records (untimed) as ``segment_format`` segments, then one timed
    ``ingest_spool`` pass into a fresh store whose backend runs ``streams`` chDB threads (the ingester's
    ``use_threads``); ``merges="off"`` stops the store's background merges (the pass alone)."""
    from persist_throughput import make_records  # the same records as the persistence benchmark

    from megatron.core.dmi.key import ParallelCoords
    from megatron.core.dmi.sinks import SpoolSink
    from megatron.core.dmi.store import schema as S
    from megatron.core.dmi.store.backend import ChdbBackend
    from megatron.core.dmi.store.ingest import _IngestPass, ingest_spool
    from megatron.core.dmi.store.segments import list_segments, verify_segment

    where = tempfile.mkdtemp(dir=root)
    size = int(record_kb * 1024) // 2 * 2
    rng = np.random.default_rng(7)
    pool = [bf16_payload(size, rng) for _ in range(8)]
    per_segment = max(1, int(segment_mb * 2**20) // size)
    n_segments = max(1, int(total_mb * 2**20) // (per_segment * size))
    spool = os.path.join(where, "spool")
    sink = SpoolSink(
        "bench",
        ParallelCoords(rank=0),
        spool,
        segment_bytes=int(segment_mb * 2**20),
        segment_records=1 << 30,
        segment_seconds=1e9,
    )
    if segment_format == "raw":
        spool_raw(sink, size, per_segment, n_segments, pool)
    else:
        for it in range(n_segments):
            sink.write(make_records(size, per_segment, it + 1, pool))
        sink.flush()
        sink.close()
    segs = [s for s in list_segments(spool) if s.kind == "tensors"]
    if not segs or any(s.raw != (segment_format == "raw") for s in segs):
        raise SystemExit(
            f"expected {segment_format} segments, the spool holds {[os.path.basename(s.path) for s in segs]}"
        )
    t0 = time.perf_counter()
    for s in segs:
        verify_segment(s)
    verify_alone = time.perf_counter() - t0
    backend = ChdbBackend(os.path.join(where, "store", "chdb"))
    load = load_average()
    try:
        backend.ensure_schema(payload_codec=codec)
        backend.use_threads(streams)
        if merges == "off":
            for table in S.TABLES:
                backend.command(f"SYSTEM STOP MERGES {backend.t(table)}")
        real_read_ahead = _IngestPass.read_ahead
        if read_ahead == "off":  # the reading thread finds nothing to do: every segment is verified in turn
            _IngestPass.read_ahead = lambda self, seg: None
        try:
            per_thread, c0, t0 = thread_cpu(), cpu_seconds(), time.perf_counter()
            r = ingest_spool(backend, spool, delete=True, max_batch_bytes=int(batch_mb * 2**20))
            wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
            busiest = busiest_threads(per_thread, thread_cpu())
        finally:
            _IngestPass.read_ahead = real_read_ahead
    finally:
        backend.close()
        shutil.rmtree(where, ignore_errors=True)
    if r.errors or r.records != n_segments * per_segment:
        raise SystemExit(
            f"ingest pass did not load every record: {r.records} of {n_segments * per_segment}: {r.errors}"
        )
    return {
        "codec": codec,
        "record_kb": record_kb,
        "format": segment_format,
        "read_ahead": read_ahead,
        "streams": streams,
        "merges": merges,
        "segments": len(segs),
        "segment_mb": segment_mb,
        "batch_mb": batch_mb,
        "records": r.records,
        "payload_mb": r.payload_bytes / 2**20,
        "GiBps": r.payload_bytes / 2**30 / wall,
        "cores_used": cpu / wall,
        "cpu_s_per_GiB": cpu / (r.payload_bytes / 2**30),
        "thread_cpu_s": busiest,
        "seconds": {"total": wall, **r.seconds},
        "read_back_share": r.seconds["read_back"] / wall,
        "verify_alone_s": verify_alone,
        "load_before": load,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--codecs", nargs="+", default=["ZSTD(1)", "LZ4", "NONE"])
    p.add_argument("--record-mb", nargs="+", type=float, default=[32])
    p.add_argument("--batch-mb", nargs="+", type=float, default=[64, 256])
    p.add_argument(
        "--paths", nargs="+", choices=["python", "streams", "file", "arrow", "union"], default=["python", "streams"]
    )
    p.add_argument("--parallel", nargs="+", type=int, default=[1, 2])
    p.add_argument("--engines", nargs="+", choices=["MergeTree", "ReplacingMergeTree"], default=["MergeTree"])
    p.add_argument("--order", nargs="+", choices=["sorted", "shuffled"], default=["sorted"])
    p.add_argument(
        "--insert-settings", nargs="+", default=["-"], help="extra INSERT settings, k=v,k=v each ('-': none)"
    )
    p.add_argument("--merges", nargs="+", choices=["on", "off"], default=["on"])
    p.add_argument("--total-mb", type=float, default=1024, help="payload per measurement")
    p.add_argument("--repeats", type=int, default=1, help="measurements of each combination (interleaved)")
    p.add_argument("--ingest", action="store_true", help="also time the real ingest pass (ingest_spool)")
    p.add_argument("--ingest-codecs", nargs="+", choices=["lz4", "zstd1", "none"], default=["lz4", "zstd1"])
    p.add_argument("--ingest-record-kb", nargs="+", type=float, default=[32768, 128])
    p.add_argument("--ingest-batch-mb", type=float, default=256, help="the ingester's max_batch_bytes, MiB")
    p.add_argument("--ingest-segment-mb", type=float, default=64, help="spool segment size, MiB (the sinks' default)")
    p.add_argument("--ingest-streams", nargs="+", type=int, default=[1], help="the ingester's chDB threads")
    p.add_argument(
        "--ingest-formats",
        nargs="+",
        choices=["raw", "parquet"],
        default=["raw"],
        help="spool segments: raw (the native ring's, as training writes them) or parquet (the Python transport's)",
    )
    p.add_argument("--ingest-merges", nargs="+", choices=["on", "off"], default=["on"], help="off: merges stopped")
    p.add_argument(
        "--read-ahead", nargs="+", choices=["on", "off"], default=["on"], help="off: verify each segment in turn"
    )
    p.add_argument("--skip-store", action="store_true", help="only the ingest pass")
    p.add_argument("--quick", action="store_true", help="smoke run: small sizes, every path once")
    p.add_argument("--dir", default=None, help="where the stores go (default: a temporary folder)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.quick:
        a.codecs, a.record_mb = ["LZ4"], [1]
        a.paths, a.parallel, a.merges, a.ingest, a.ingest_codecs = (
            ["python", "streams", "file", "arrow", "union"],
            [2],
            ["on"],
            True,
            ["lz4"],
        )
        a.total_mb, a.batch_mb = 128, [128]  # two streams of 64 MiB (MIN_STREAM_BYTES)
        a.ingest_record_kb, a.ingest_batch_mb, a.ingest_segment_mb = [1024], 128, 32
        a.ingest_streams = [1, 2]
        a.ingest_formats = ["raw", "parquet"]
        a.read_ahead = ["on", "off"]
    root = a.dir or tempfile.mkdtemp(prefix="dmi_ingest_")
    os.makedirs(root, exist_ok=True)
    uptime_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    rows, ingest_rows = [], []
    try:
        if not a.skip_store:
            print(
                f"{'rec MiB':>7} {'batch':>5} {'codec':>8} {'engine':>9} {'order':>8} {'path':>7} {'par':>3} {'merges':>6} "
                f"{'GiB/s':>6} {'cores':>5} {'cpu/GiB':>7} {'parts':>5} {'ratio':>5} {'load':>5}  busiest threads (CPU s); settings"
            )
            combos = list(
                itertools.product(
                    a.record_mb,
                    a.batch_mb,
                    a.codecs,
                    a.engines,
                    a.order,
                    a.paths,
                    a.parallel,
                    a.merges,
                    a.insert_settings,
                )
            )
            for rep in range(a.repeats):
                for record_mb, batch_mb, codec, engine, order, path, parallel, merges, extra in combos:
                    extra = "" if extra == "-" else extra
                    r = measure_store(
                        root,
                        codec,
                        record_mb,
                        batch_mb,
                        path,
                        parallel,
                        merges,
                        a.total_mb,
                        seed=len(rows),
                        engine=engine,
                        order=order,
                        extra=extra,
                    )
                    r["repeat"] = rep
                    rows.append(r)
                    print(
                        f"{record_mb:>7g} {batch_mb:>5g} {codec:>8} {engine[:9]:>9} {order:>8} {path:>7} {parallel:>3} {merges:>6} "
                        f"{r['GiBps']:>6.3f} {r['cores_used']:>5.2f} {r['cpu_s_per_GiB']:>7.2f} {r['parts']:>5} "
                        f"{r['ratio'] or 0:>5.2f} {r['load_before']:>5.1f}  {r['thread_cpu_s']} {extra}"
                        + (f"  ERROR {r['errors'][0]}" if r["errors"] else "" if r["rows_ok"] else "  ROWS MISSING"),
                        flush=True,
                    )
        if a.ingest:
            print(
                f"\n{'rec KiB':>7} {'format':>7} {'codec':>6} {'ahead':>5} {'str':>3} {'merges':>6} {'GiB/s':>6} {'cores':>5} {'cpu/GiB':>7} {'verify':>6} {'insert':>6} {'readbk':>6} {'record':>6} {'rb %':>5} {'alone':>6} {'load':>5}  busiest threads"
            )
            combos = list(
                itertools.product(
                    a.ingest_record_kb,
                    a.ingest_formats,
                    a.ingest_codecs,
                    a.read_ahead,
                    a.ingest_streams,
                    a.ingest_merges,
                )
            )
            for rep in range(a.repeats):
                for record_kb, fmt, codec, ahead, streams, merges in combos:
                    r = measure_ingest(
                        root,
                        codec,
                        record_kb,
                        a.total_mb,
                        a.ingest_segment_mb,
                        a.ingest_batch_mb,
                        ahead,
                        streams,
                        merges,
                        fmt,
                    )
                    r["repeat"] = rep
                    ingest_rows.append(r)
                    s = r["seconds"]
                    print(
                        f"{record_kb:>7g} {fmt:>7} {codec:>6} {ahead:>5} {streams:>3} {merges:>6} {r['GiBps']:>6.3f} {r['cores_used']:>5.2f} {r['cpu_s_per_GiB']:>7.2f} "
                        f"{s['verify']:>6.2f} {s['insert']:>6.2f} {s['read_back']:>6.2f} {s['record']:>6.2f} {100 * r['read_back_share']:>5.1f} "
                        f"{r['verify_alone_s']:>6.2f} {r['load_before']:>5.1f}  {r['thread_cpu_s']}",
                        flush=True,
                    )
    finally:
        if not a.dir:
            shutil.rmtree(root, ignore_errors=True)
    uptime_after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"\nuptime before: {uptime_before}\nuptime after:  {uptime_after}")
    if a.json:
        import chdb

        write_json(
            a.json,
            {
                "host": platform.node(),
                "cpus": os.cpu_count(),
                "chdb": chdb.__version__,
                "uptime_before": uptime_before,
                "uptime_after": uptime_after,
                "args": vars(a),
                "store": rows,
                "ingest": ingest_rows,
            },
        )


if __name__ == "__main__":
    main()
