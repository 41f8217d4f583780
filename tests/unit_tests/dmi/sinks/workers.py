"""Hand-built records and functions that run in their own process (chDB: one store per process).

Every function here is module-level so ``run_isolated`` can ship it to a fresh process.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from megatron.core.dmi.config import DMIConfig
from megatron.core.dmi.key import ParallelCoords, RecordKey
from megatron.core.dmi.records import Record, dtype_name, tensor_to_payload
from megatron.core.dmi.sinks import RunInfo, open_sink

# How long the two writers of the store-owner test wait for each other: a guard against a hang,
# long enough that a loaded machine (a JIT build of the ring taking minutes) never cuts it short.
HANDSHAKE_S = 600
RUN = "run-a"


def make_key(
    output: str,
    t: torch.Tensor,
    *,
    run_id: str = RUN,
    phase: str = "train",
    iteration: int = 1,
    attempt: int = 1,
    microbatch: int = 0,
    invocation: int = 0,
    layer: int = 0,
    rank: int = 0,
    tp: int = 0,
    dp: int = 0,
    cp: int = 0,
    shard_index: int = 0,
    shard_count: int = 1,
    token_start: int = 0,
    token_end: int | None = None,
    token_total: int | None = None,
) -> RecordKey:
    n = t.shape[0] if t.dim() else 1
    token_end = token_start + n if token_end is None else token_end
    token_total = token_end if token_total is None else token_total
    return RecordKey(
        run_id,
        phase,
        iteration,
        attempt,
        microbatch,
        invocation,
        layer,
        output,
        ParallelCoords(rank=rank, tp=tp, dp=dp, cp=cp),
        shard_index,
        shard_count,
        token_start,
        token_end,
        token_total,
        dtype_name(t.dtype),
        tuple(t.shape),
    )


def rec(output: str, t: torch.Tensor, **kw) -> Record:
    return Record(make_key(output, t, **kw), tensor_to_payload(t))


def dtype_records(seed: int = 0) -> list[Record]:
    """One record per dtype, plus a zero-row record, at distinct layers."""
    g = torch.Generator().manual_seed(seed)
    ts = [
        ("router.logits", torch.randn(16, 8, generator=g)),
        ("router.logits", torch.randn(16, 8, generator=g).to(torch.bfloat16)),
        ("router.topk_probs", torch.randn(16, 2, generator=g).to(torch.float16)),
        ("router.topk_ids", torch.randint(0, 9, (16, 2), generator=g, dtype=torch.int32)),
        ("router.topk_ids", torch.randint(-(2**40), 2**40, (16, 2), generator=g, dtype=torch.int64)),
        ("router.logits", torch.empty(0, 8)),
    ]
    out = []
    for i, (name, t) in enumerate(ts):
        # special float values survive bitwise too
        if t.is_floating_point() and t.numel():
            t = t.clone()
            t.view(-1)[0] = float("nan")
            t.view(-1)[1] = float("-inf")
            t.view(-1)[2] = -0.0
        out.append(rec(name, t, layer=i))
    return out


def moe_records(
    run_id: str = RUN,
    iterations=range(1, 4),
    layers=(0, 1),
    experts: int = 4,
    attempt: int = 1,
    seed: int = 0,
    tp: int = 2,
    sp: bool = True,
    tokens: int = 8,
) -> list[Record]:
    """A little MoE capture: per (iteration, layer) router.logits and router.expert_counts from
    ``tp`` TP ranks; with ``sp`` each TP rank routes half of the tokens, else every rank routes all
    of them (replicated producers)."""
    out = []
    g = torch.Generator().manual_seed(seed)
    for it in iterations:
        for layer in layers:
            logits = torch.randn(tokens, experts, generator=g)
            ids = logits.topk(2, dim=-1).indices
            for r in range(tp):
                if sp:
                    lo, hi = r * tokens // tp, (r + 1) * tokens // tp
                else:
                    lo, hi = 0, tokens
                part_ids = ids[lo:hi]
                pre = torch.bincount(part_ids.reshape(-1), minlength=experts).to(torch.int32)
                post = pre.clone()
                post[0] = max(0, int(post[0]) - 1)  # one dropped slot on expert 0
                counts = torch.stack([pre, post])
                kw = dict(
                    run_id=run_id,
                    iteration=it,
                    attempt=attempt,
                    layer=layer,
                    rank=r,
                    tp=r,
                    token_start=lo,
                    token_end=hi,
                    token_total=tokens,
                )
                out.append(rec("router.logits", logits[lo:hi].contiguous(), **kw))
                out.append(Record(make_key("router.expert_counts", counts, **kw), tensor_to_payload(counts)))
    return out


def run_info(
    run_id: str = RUN, attempt: int = 1, resumed_from=None, rank: int = 0, layers=(0, 1), world: int = 1, tp: int = 0
) -> RunInfo:
    return RunInfo(
        run_id,
        attempt,
        resumed_from,
        {"hooks": ["router"], "note": "test"},
        coords=ParallelCoords(rank=rank, tp=tp),
        layers=list(layers),
        world_size=world,
    )


# -- functions run in a fresh process ---------------------------------------------------------


def write_embedded(
    store_dir: str,
    records: list[Record],
    infos: list[RunInfo] = (),
    rank: int = 0,
    is_ingester: bool = True,
    wait_for: str | None = None,
    drops=(),
    batch: int = 5,
) -> dict:
    """One rank's StoreSink: write everything, close; returns the report as a dict."""
    cfg = DMIConfig(persist="clickhouse", store_dir=store_dir)
    sink = open_sink(cfg, ParallelCoords(rank=rank), records[0].key.run_id if records else RUN, is_ingester)
    for info in infos:
        sink.write_run(info)
    for i in range(0, len(records), batch):
        sink.write(records[i : i + batch])
    if drops:
        sink.write_drops(list(drops), "ring full")
    if wait_for:  # stands in for the training integration's barrier before rank 0's final ingest
        deadline = time.time() + 60
        while not os.path.exists(wait_for) and time.time() < deadline:
            time.sleep(0.05)
    return dataclasses.asdict(sink.close())


def write_rank_then_signal(store_dir: str, records: list[Record], rank: int, flag: str) -> dict:
    rep = write_embedded(store_dir, records, [run_info(rank=rank, world=2)], rank=rank, is_ingester=False)
    open(flag, "w").close()
    return rep


def write_spool(
    store_dir: str,
    records: list[Record],
    infos: list[RunInfo] = (),
    rank: int = 0,
    batch: int = 5,
    segment_records: int = 8192,
) -> dict:
    cfg = DMIConfig(persist="spool", store_dir=store_dir)
    sink = open_sink(cfg, ParallelCoords(rank=rank), RUN, False)
    sink.segment_records = segment_records
    for info in infos:
        sink.write_run(info)
    for i in range(0, len(records), batch):
        sink.write(records[i : i + batch])
    return dataclasses.asdict(sink.close())


def write_server(store_dir: str, url: str, records: list[Record], infos: list[RunInfo] = ()) -> dict:
    cfg = DMIConfig(persist="clickhouse", store_dir=store_dir, clickhouse_url=url)
    sink = open_sink(cfg, ParallelCoords(rank=0), RUN, True)
    for info in infos:
        sink.write_run(info)
    for i in range(0, len(records), 4):
        sink.write(records[i : i + 4])
    sink.flush()
    lag = sink.store_lag().rows
    return dict(dataclasses.asdict(sink.close()), store_lag_before_close=lag)


def read_records(store_dir: str, keys: list[RecordKey]) -> list[bytes]:
    """Payload bytes of one record per key (the records must be unsharded)."""
    from megatron.core.dmi.reader import open_store

    with open_store(store_dir) as store:
        out = []
        for k in keys:
            recs = store.records(
                k.run_id, k.output, k.iteration, k.microbatch, k.layer, k.phase, k.coords.dp, k.invocation
            )
            assert len(recs) == 1, recs
            assert recs[0].key == k, (recs[0].key, k)
            out.append(recs[0].payload)
        return out


def read_tensors(store_dir: str, queries: list[dict]) -> list:
    """``store.tensor(**q)`` for each query; exceptions come back as ('error', type, message)."""
    from megatron.core.dmi.reader import open_store

    with open_store(store_dir) as store:
        out = []
        for q in queries:
            try:
                out.append(store.tensor(**q))
            except Exception as e:
                out.append(("error", type(e).__name__, str(e)))
        return out


def dump_store(store_dir: str, tables=("tensors", "expert_counts", "runs", "topology", "drops")) -> dict:
    """Every row of the given tables (FINAL, without timestamps/hostnames), sorted, for comparison."""
    from megatron.core.dmi.reader import open_store

    skip = {"started_at", "dropped_at", "closed_at", "ingested_at", "hostname", "versions_json"}
    with open_store(store_dir) as store:
        out = {}
        for t in tables:
            rows = store.sql(f"SELECT * FROM dmi.{t} FINAL").to_pylist()
            rows = [
                tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(r.items()) if k not in skip)
                for r in rows
            ]
            out[t] = sorted(rows, key=repr)
        out["_ingest"] = dataclasses.asdict(store.ingest_result)
        return out


def store_call(store_dir: str, method: str, *args, **kwargs):
    """``getattr(open_store(store_dir), method)(*args, **kwargs)``."""
    from megatron.core.dmi.reader import open_store

    with open_store(store_dir) as store:
        return getattr(store, method)(*args, **kwargs)


def open_store_error(store_dir: str, writable: bool = False) -> tuple[str, str]:
    from megatron.core.dmi.reader import open_store

    try:
        open_store(store_dir, writable=writable).close()
    except Exception as e:
        return type(e).__name__, str(e)
    return "", ""


def set_schema_version(store_dir: str, version: int) -> None:
    from megatron.core.dmi.store.backend import ChdbBackend

    b = ChdbBackend(os.path.join(store_dir, "chdb"))
    try:
        b.ensure_schema()
        b.command("TRUNCATE TABLE dmi.schema_version")
        b.command("INSERT INTO dmi.schema_version (version) VALUES ({v:UInt32})", {"v": version})
    finally:
        b.close()


def load_on_threads(store_dir: str, spool: str, threads: int | None) -> dict:
    """``Store.load`` of ``spool`` into a new embedded store on ``threads``; the records it loaded and the chDB
    session's thread settings after it."""
    from megatron.core.dmi.reader import open_store

    os.makedirs(store_dir)
    with open_store(store_dir, writable=True) as store:
        r = store.load(spool, threads=threads)
        settings = store.backend.query_arrow(
            "SELECT getSetting('max_threads') AS max_threads, getSetting('max_insert_threads') AS max_insert_threads"
        ).to_pylist()[0]
    return {"records": r.records, "settings": {k: int(v) for k, v in settings.items()}}


def load_cli(argv: list[str]) -> tuple[int, str]:
    """Run the CLI in this process, capturing stdout."""
    import contextlib
    import io

    from megatron.core.dmi.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    return rc, buf.getvalue()


def cli_stderr(argv: list[str]) -> tuple[int, str]:
    """Run the CLI in this process, capturing stderr (where its errors go)."""
    import contextlib
    import io

    from megatron.core.dmi.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        rc = main(argv)
    return rc, buf.getvalue()


def run_plot_example(store_dir: str, out_dir: str) -> list[str]:
    import importlib.util

    root = os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    )
    spec = importlib.util.spec_from_file_location("plot_dmi", os.path.join(root, "examples", "plot_dmi.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main([store_dir, "--out", out_dir])


def ingest_while_running(store_dir: str) -> dict:
    """The ingester thread loads flushed segments during the run, not only at close."""
    from megatron.core.dmi.sinks import StoreSink

    sink = StoreSink(store_dir, RUN, ParallelCoords(rank=0), True, ingest_poll_s=0.1)
    sink.write_run(run_info())
    sink.write(moe_records())
    sink.flush()
    folder = os.path.join(store_dir, "spool", "rank-00000")
    deadline = time.time() + 30
    # the pass retires segments before it adds its counts to ``result``: wait on the counts
    while (sink.ingester.result.segments_loaded < 3 or os.listdir(folder)) and time.time() < deadline:
        time.sleep(0.05)
    loaded = sink.ingester.result.segments_loaded
    emptied = not os.listdir(folder)
    rep = sink.close()
    return {"emptied": emptied, "loaded_before_close": loaded, "report": dataclasses.asdict(rep)}


def ingest_and_count(store_dir: str, spool: str, env: dict | None = None, fault: str = "", **ingest_kwargs) -> dict:
    """``ingest_spool`` (deleting what it loads) into the chDB store under ``store_dir``; returns
    its result and, by plain SQL, the stored tensors, quarantine rows and segment rows.
    ``fault`` injects one into the real store: ``lossy_insert``: the tensors table's inserts keep
    every other row and return without error; ``segments_refused``: the store refuses the inserts
    into its segments table (where ingest records a loaded segment) as a full disk would;
    ``stored_then_refused``: the tensors table's inserts store every row, then raise (as chDB did
    on a nearly full disk). ``ingest_kwargs`` go to ``ingest_spool``."""
    from megatron.core.dmi.store.backend import ChdbBackend
    from megatron.core.dmi.store.ingest import ingest_spool

    full = "Code: 243. DB::Exception: Cannot reserve 1.00 MiB, not enough space (injected)"

    class FaultyStore(ChdbBackend):
        def insert_arrow(self, table, data):
            if fault == "segments_refused" and table == "segments":
                raise RuntimeError(full)
            keep = (
                data.take(list(range(0, data.num_rows, 2))) if fault == "lossy_insert" and table == "tensors" else data
            )
            super().insert_arrow(table, keep)
            if fault == "stored_then_refused" and table == "tensors":
                raise RuntimeError(full)

    os.environ.update(env or {})
    b = FaultyStore(os.path.join(store_dir, "chdb"))
    try:
        b.ensure_schema()
        r = ingest_spool(b, spool, delete=True, **ingest_kwargs)
        q = lambda sql: b.query_arrow(sql).to_pylist()  # noqa: E731
        return {
            "result": dataclasses.asdict(r),
            "tensors": q("SELECT phase, iteration, microbatch, layer, payload FROM dmi.tensors FINAL"),
            "quarantine": q("SELECT row, reason, iteration FROM dmi.quarantine ORDER BY row"),
            "segments": q("SELECT status, rows FROM dmi.segments WHERE kind = 'tensors'"),
        }
    finally:
        b.close()


def hold_spool_open(store_dir: str, ready: str, release: str) -> dict:
    """A run's native spool writer with a segment open (a `.tmp` file) until ``release`` exists;
    then it closes. Returns its report and the records its segments hold."""
    from megatron.core.dmi.drain import Drain
    from megatron.core.dmi.sinks import SpoolSink
    from megatron.core.dmi.store.segments import list_segments, segment_rows_bytes
    from megatron.core.dmi.transport.native import NativeRingTransport

    ring = NativeRingTransport(4 << 20, "block", "cpu", block_timeout=DMIConfig.block_timeout)
    sink = SpoolSink(RUN, ParallelCoords(rank=0), os.path.join(store_dir, "spool"), segment_bytes=1 << 30)
    drain = Drain(ring, sink, linger_bytes=0)
    records = moe_records()
    for r in records:
        assert ring.publish(r.key, r.tensor())
    deadline = time.time() + HANDSHAKE_S
    while ring.spool_stats()["open_rows"] < len(records) and time.time() < deadline:
        time.sleep(0.01)
    open(ready, "w").close()
    while not os.path.exists(release) and time.time() < deadline:
        time.sleep(0.01)
    drain.close()
    ring.close()
    rep = sink.close()
    held = sum(segment_rows_bytes(s)[0] for s in list_segments(os.path.join(store_dir, "spool")) if s.raw)
    return {"report": dataclasses.asdict(rep), "held": held, "published": len(records)}


def start_second_writer(store_dir: str, ready: str, release: str) -> str:
    """A second run on the same store while the first writes: its sink refuses to start (the
    message), or starts and prepares its native writer as a run would ("started")."""
    from megatron.core.dmi.sinks import SpoolSink
    from megatron.core.dmi.sinks.owner import StoreInUseError

    deadline = time.time() + HANDSHAKE_S
    while not os.path.exists(ready) and time.time() < deadline:
        time.sleep(0.01)
    try:
        sink = SpoolSink("run-b", ParallelCoords(rank=0), os.path.join(store_dir, "spool"))
        sink.spool.native_target(1 << 20)
        return "started"
    except StoreInUseError as e:
        return str(e)
    finally:
        open(release, "w").close()


def insert_in_streams(store_dir: str, streams: int) -> dict:
    """One ``insert_arrow`` of 16 float32 records (4 MiB) into a store whose backend runs ``streams`` threads,
    the smallest stream lowered to 1 MiB so that this batch is four streams' worth, background merges stopped
    so the parts stay as the insert wrote them. Returns the parts written, the rows not read back and whether
    every payload reads back bit for bit."""
    from megatron.core.dmi.records import records_to_table
    from megatron.core.dmi.store import backend as B
    from megatron.core.dmi.store.ingest import rows_missing

    B.MIN_STREAM_BYTES = 1 << 20
    g = torch.Generator().manual_seed(streams)
    recs = [rec("attn.context", torch.randn(256, 256, generator=g), layer=i % 4, microbatch=i) for i in range(16)]
    table = records_to_table(recs)
    b = B.ChdbBackend(os.path.join(store_dir, "chdb"))
    try:
        b.ensure_schema()
        b.use_threads(streams)
        b.command("SYSTEM STOP MERGES dmi.tensors")
        b.insert_arrow("tensors", table)
        parts = b.query_arrow(
            "SELECT count() AS n FROM system.parts WHERE database = 'dmi' AND table = 'tensors' AND active"
        )
        stored = b.query_arrow("SELECT layer, microbatch, payload FROM dmi.tensors ORDER BY microbatch")
        return {
            "parts": parts.column("n")[0].as_py(),
            "missing": int(rows_missing(b, "tensors", table).sum()),
            "payloads_equal": stored.column("payload").to_pylist() == [r.payload for r in recs],
        }
    finally:
        b.close()
