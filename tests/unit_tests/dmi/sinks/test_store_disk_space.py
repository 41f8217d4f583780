"""The embedded store on a nearly full disk (issue 17 item 1), on a real 20 MiB tmpfs with a real
chDB store: below about 1 MiB free chDB returns from an INSERT without an error and stores
nothing. Ingest must not trust it: a segment leaves the spool only once its rows are read back,
and below the free-space margin ingest pauses and says so."""

import os

import pytest

from megatron.core.dmi.records import ParallelCoords
from megatron.core.dmi.sinks import SpoolSink
from megatron.core.dmi.sinks.isolated import run_isolated
from megatron.core.dmi.sinks.spool import list_segments
from tests.fault_tests.tmpfs import fill, small_tmpfs
from tests.unit_tests.dmi.sinks import workers as W

RECORDS = W.moe_records(iterations=range(1, 41))


@pytest.fixture
def nearly_full_store(tmp_path):
    """A store (schema created) whose spool holds a run's segments, on a 20 MiB tmpfs left with
    1.1 MiB free."""
    mnt = str(tmp_path / "small")
    with small_tmpfs(mnt, "20m") as why:
        if why:
            pytest.skip(why)
        store = os.path.join(mnt, "store")
        run_isolated(W.ingest_and_count, store, os.path.join(store, "spool"))  # creates the store
        sink = SpoolSink(W.RUN, ParallelCoords(rank=0), os.path.join(store, "spool"))
        sink.write(RECORDS)
        sink.close()
        fill(mnt, leave_bytes=int(1.1 * 2**20))
        yield store


def test_an_insert_that_stores_nothing_is_caught_and_its_segment_kept(nearly_full_store):
    store = nearly_full_store
    before = {os.path.basename(s.path) for s in list_segments(os.path.join(store, "spool"))}
    out = run_isolated(W.ingest_and_count, store, os.path.join(store, "spool"), {"DMI_STORE_MIN_FREE_MB": "0"})
    r = out["result"]
    left = {os.path.basename(s.path) for s in list_segments(os.path.join(store, "spool"))}
    # the fault happened (chDB lost an insert) and was caught: before, the segment was deleted
    assert r["segments_unverified"] >= 1 and left, r["errors"]
    assert any("not found in the store after the insert" in e for e in r["errors"])
    assert r["segments_loaded"] + len(left) == len(before)  # every segment: verified in, or still here
    assert sum(n for n, _ in r["verified"].values()) == len(out["tensors"])  # counted = what the store holds


def test_ingest_pauses_below_the_free_space_margin(nearly_full_store):
    store = nearly_full_store
    before = sorted(s.path for s in list_segments(os.path.join(store, "spool")))
    out = run_isolated(W.ingest_and_count, store, os.path.join(store, "spool"))  # default margin, 16 MiB
    r = out["result"]
    assert r["paused"].startswith("ingest paused: the store's file system has 1.") and "16 MiB margin" in r["paused"]
    assert r["errors"] == [r["paused"]] and r["segments_loaded"] == 0 and out["tensors"] == []
    assert sorted(s.path for s in list_segments(os.path.join(store, "spool"))) == before  # nothing deleted
