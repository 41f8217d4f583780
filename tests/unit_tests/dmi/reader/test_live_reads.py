"""Reading a store while a run writes it (issue 20): readers work from a snapshot, never hold the
store, never change what is on disk; an ingester that starts beside a reader still owns the store."""

from __future__ import annotations

import os
import threading

from megatron.core.dmi.reader.snapshot import _active_parts
from tests.unit_tests.dmi.isolated import run_isolated
from tests.unit_tests.dmi.reader import live_workers as L
from tests.unit_tests.dmi.sinks import workers as W


def _in_background(fn, *args):
    """``run_isolated(fn, *args)`` on a thread; the returned dict gets its result under "result"."""
    out: dict = {}

    def call():
        try:
            out["result"] = run_isolated(fn, *args, timeout=600)
        except BaseException as e:  # surfaced by the test's assertion on "result"
            out["error"] = e

    t = threading.Thread(target=call, daemon=True)
    t.start()
    out["thread"] = t
    return out


def _disk(path: str) -> dict:
    return {
        os.path.relpath(os.path.join(r, f), path): os.stat(os.path.join(r, f)).st_size
        for r, _, fs in os.walk(path)
        for f in fs
    }


def test_reader_sees_a_live_store_while_its_ingester_holds_it(tmp_path):
    d = str(tmp_path / "store")
    first = W.moe_records(iterations=range(1, 3))
    more = W.moe_records(iterations=range(3, 6), seed=1)
    run_isolated(W.write_spool, d, first, [W.run_info()])
    ready, stop = str(tmp_path / "ready"), str(tmp_path / "stop")
    holder = _in_background(L.hold_ingester, d, ready, stop)
    L._wait_for(ready)
    assert open(ready).read() == "owner"
    try:
        assert run_isolated(L.records_seen, d) == len(first)  # no StoreBusyError: a snapshot
        run_isolated(W.write_spool, d, more)
        assert run_isolated(L.records_seen, d) == len(first) + len(more)
    finally:
        open(stop, "w").close()
        holder["thread"].join(600)
    assert "result" in holder, holder.get("error")
    assert holder["result"]["owner"] and holder["result"]["records"] == len(first) + len(more)
    assert not holder["result"]["errors"]
    assert not os.path.exists(os.path.join(d, ".readers")), "readers leave no snapshot behind"


def test_ingester_starting_beside_an_open_reader_owns_the_store(tmp_path):
    d = str(tmp_path / "store")
    recs = W.moe_records()
    run_isolated(W.write_embedded, d, recs, [W.run_info()])
    more = W.moe_records(run_id="run-b", iterations=range(4, 6))
    ready, stop = str(tmp_path / "ready"), str(tmp_path / "stop")
    reader = _in_background(L.hold_reader, d, ready, stop)
    L._wait_for(ready)
    try:
        run_isolated(W.write_spool, d, more)
        got = run_isolated(L.ingest_all, d)
    finally:
        open(stop, "w").close()
        reader["thread"].join(600)
    assert reader.get("result") == len(recs), reader.get("error")
    assert got == {"owner": True, "records": len(more)}
    assert run_isolated(L.records_seen, d) == len(recs) + len(more)


def test_show_on_a_spool_store_changes_nothing_on_disk(tmp_path):
    d = str(tmp_path / "store")
    recs = W.moe_records()
    run_isolated(W.write_spool, d, recs, [W.run_info()])
    before = _disk(d)
    assert any(p.startswith("spool") for p in before)
    rc, out = run_isolated(W.load_cli, ["show", d])
    assert rc == 0 and f"run {W.RUN}: {len(recs)} records" in out, out
    assert "spool segment(s) not in the store yet" in out
    assert _disk(d) == before


def test_snapshot_links_only_parts_no_merge_covers():
    names = ["all_1_1_0", "all_2_2_0", "all_1_2_1", "all_3_3_0", "all_3_3_0_4", "detached", "tmp_insert_all_5_5_0"]
    assert _active_parts(names) == (["all_1_2_1", "all_3_3_0_4"], 3)
