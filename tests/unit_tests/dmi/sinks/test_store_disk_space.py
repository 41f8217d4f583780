"""The embedded store on a nearly full disk (issue 17 item 1), on a real 20 MiB tmpfs with a real
chDB store. Below about 1 MiB free chDB either refuses the insert (NOT_ENOUGH_SPACE, through the
Python() table function the backend inserts with) or, with its streamed insert, returned without an
error and stored nothing. Ingest trusts neither: a refused batch stays in the spool, a segment
leaves the spool only once its rows are read back (a lossy insert is injected below to show it),
and below the free-space margin ingest pauses and says so."""

import os

import pytest

from megatron.core.dmi.key import ParallelCoords
from megatron.core.dmi.sinks import SpoolSink
from megatron.core.dmi.store.segments import list_segments
from tests.fault_tests.tmpfs import fill, small_tmpfs
from tests.unit_tests.dmi.isolated import run_isolated
from tests.unit_tests.dmi.sinks import workers as W

RECORDS = W.moe_records(iterations=range(1, 41))


def spooled_store(store: str) -> str:
    """A store with its schema created and a run's segments (RECORDS) waiting in its spool."""
    run_isolated(W.ingest_and_count, store, os.path.join(store, "spool"))  # creates the store
    sink = SpoolSink(W.RUN, ParallelCoords(rank=0), os.path.join(store, "spool"))
    sink.write(RECORDS)
    sink.close()
    return store


def tensor_segments(store: str) -> set[str]:
    return {s.path for s in list_segments(os.path.join(store, "spool")) if s.kind == "tensors"}


@pytest.fixture
def nearly_full_store(tmp_path):
    """A store (schema created) whose spool holds a run's segments, on a 20 MiB tmpfs left with
    1.1 MiB free."""
    mnt = str(tmp_path / "small")
    with small_tmpfs(mnt, "20m") as why:
        if why:
            pytest.skip(why)
        store = spooled_store(os.path.join(mnt, "store"))
        fill(mnt, leave_bytes=int(1.1 * 2**20))
        yield store


# what ingest says when the store did not take a batch: refused, or taken and not found
STORE_DID_NOT_TAKE = ("NOT_ENOUGH_SPACE", "not found in the store after the insert")


def test_an_insert_the_full_disk_cannot_take_is_caught_and_its_segment_kept(nearly_full_store):
    store = nearly_full_store
    before = {os.path.basename(s.path) for s in list_segments(os.path.join(store, "spool"))}
    out = run_isolated(W.ingest_and_count, store, os.path.join(store, "spool"), {"DMI_STORE_MIN_FREE_MB": "0"})
    r = out["result"]
    left = {os.path.basename(s.path) for s in list_segments(os.path.join(store, "spool"))}
    # the fault happened (chDB could not store a batch) and was caught: the segment was kept
    assert r["segments_unverified"] >= 1 and left, r["errors"]
    assert any(any(said in e for said in STORE_DID_NOT_TAKE) for e in r["errors"]), r["errors"]
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


def test_rows_an_insert_loses_silently_are_caught_by_the_read_back(tmp_path):
    """An insert that returns without error and stores only part of its batch (injected: the
    backend's insert drops every other row before a real chDB insert) is caught by reading the
    batch back: those segments stay in the spool, and `verified` counts only what the store holds."""
    store = spooled_store(str(tmp_path / "store"))
    waiting = tensor_segments(store)
    out = run_isolated(W.ingest_and_count, store, os.path.join(store, "spool"), None, "lossy_insert")
    r = out["result"]
    left = {s.path for s in list_segments(os.path.join(store, "spool"))}
    assert waiting and waiting <= left, r  # every tensor segment kept
    assert r["segments_unverified"] == len(waiting)
    assert any("not found in the store after the insert" in e for e in r["errors"]), r["errors"]
    assert sum(n for n, _ in r["verified"].values()) == 0


def test_a_refused_segments_record_keeps_the_records_credited_and_the_segment_for_a_retry(tmp_path):
    """The tensors of a batch are inserted and read back, then the store refuses the row that
    records the segment as loaded (seen on CI with a nearly full disk: the report then said
    "dropped"). The records are in the store and credited as such, the segment stays in the spool,
    and a later pass loads it again without a duplicate."""
    store = spooled_store(str(tmp_path / "store"))
    waiting = tensor_segments(store)
    out = run_isolated(W.ingest_and_count, store, os.path.join(store, "spool"), None, "segments_refused")
    r = out["result"]
    assert any("failed: " in e and "segments stay in the spool" in e for e in r["errors"]), r["errors"]
    assert sum(n for n, _ in r["verified"].values()) == len(out["tensors"]) == len(RECORDS)  # credited: they are in
    assert waiting <= {s.path for s in list_segments(os.path.join(store, "spool"))}  # kept for a retry
    again = run_isolated(W.ingest_and_count, store, os.path.join(store, "spool"))
    assert len(again["tensors"]) == len(RECORDS) and not again["result"]["errors"], again["result"]
    assert not {s.path for s in list_segments(os.path.join(store, "spool"))} & waiting


def test_rows_a_refused_insert_stored_anyway_are_credited(tmp_path):
    """The store raises from the tensors insert after storing every row (CI saw it on a nearly
    full disk: the report said "written 32" while the store held 64). The read-back decides: the
    records count as written, and the segments stay for a retry that adds no duplicate."""
    store = spooled_store(str(tmp_path / "store"))
    waiting = tensor_segments(store)
    out = run_isolated(W.ingest_and_count, store, os.path.join(store, "spool"), None, "stored_then_refused")
    r = out["result"]
    assert any("are in the store nevertheless" in e for e in r["errors"]), r["errors"]
    assert sum(n for n, _ in r["verified"].values()) == len(out["tensors"]) == len(RECORDS)
    assert r["segments_unverified"] == len(waiting)
    assert waiting <= {s.path for s in list_segments(os.path.join(store, "spool"))}
    again = run_isolated(W.ingest_and_count, store, os.path.join(store, "spool"))
    assert len(again["tensors"]) == len(RECORDS) and not again["result"]["errors"], again["result"]
    assert not {s.path for s in list_segments(os.path.join(store, "spool"))} & waiting
