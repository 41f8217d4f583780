"""The chDB-free spool reader (reader/spool.py) against the chDB reader on the same spool-only stores:
real Parquet segments written by the spool sink, each chDB store opened in its own process."""

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron.core.dmi.errors import InvalidArgumentError
from megatron.core.dmi.reader.errors import AmbiguousLayerError, StoreError
from megatron.core.dmi.reader.selection import TensorSelection
from megatron.core.dmi.reader.spool import open_spool_run, spool_only
from megatron.core.dmi.records import records_to_table
from megatron.core.dmi.sinks.spool import SpoolWriter
from megatron.core.dmi.store.segments import list_segments
from tests.unit_tests.dmi.isolated import run_isolated
from tests.unit_tests.dmi.sinks import workers as W


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> str:
    """A spool-only store of one run in two attempts: the second resumed from iteration 3 and rewrote 4-6."""
    store = str(tmp_path_factory.mktemp("resumed"))
    W.write_spool(store, W.moe_records(iterations=range(1, 6), attempt=1, seed=0), [W.run_info(attempt=1)])
    W.write_spool(
        store, W.moe_records(iterations=range(4, 7), attempt=2, seed=1), [W.run_info(attempt=2, resumed_from=3)]
    )
    return store


def test_it_sees_the_attempts_and_tensors_the_chdb_reader_sees(resumed):
    assert spool_only(resumed)
    run = open_spool_run(resumed)
    records = run.read_records(output=["router.logits"])
    assert run.run_id == W.RUN and sorted(run.attempts) == [1, 2]
    assert records.visible == run_isolated(W.store_call, resumed, "visible_attempts", W.RUN)
    assert records.iterations() == [1, 2, 3, 4, 5, 6] and records.layers("router.logits") == {0, 1}
    assert records.layers("router.expert_counts") == {0, 1}  # not kept, still counted
    mine = records.rebuild_each("router.logits")
    theirs = run_isolated(W.store_call, resumed, "rebuild_each", W.RUN, "router.logits")
    assert mine.keys() == theirs.keys() and len(mine) == 6 * 2
    for key in mine:  # iterations 4-6 from attempt 2, each from both sequence-parallel shards
        assert mine[key].dtype == theirs[key].dtype and np.array_equal(mine[key].values, theirs[key].values)
    assert np.array_equal(records.rebuild("router.logits", 4, layer=1).values, mine[(4, 0, 1, 0)].values)
    with pytest.raises(StoreError, match="no train records at iteration 7 \\(captured: 1-6\\)"):
        records.rebuild("router.logits", 7)


def test_a_tensor_is_selected_as_the_chdb_reader_selects_it(resumed):
    """``records`` and ``rebuild`` take the chDB reader's ``TensorSelection`` (its fields but the run, or one
    selection of this run), with its defaults: the one layer captured, one data-parallel rank to rebuild."""
    records = open_spool_run(resumed).read_records(output=["router.logits"])
    sel = TensorSelection(W.RUN, "router.logits", 4, layer=1)
    theirs = run_isolated(W.store_call, resumed, "rebuild", sel)
    for mine in (
        records.rebuild(sel),
        records.rebuild("router.logits", 4, 0, 1, "train", 0, 0),
        records.rebuild(output="router.logits", iteration=4, layer=1),
    ):
        assert mine.dtype == theirs.dtype and np.array_equal(mine.values, theirs.values)
    assert [r.key for r in records.records(sel)] == [
        r.key for r in records.records("router.logits", 4, layer=1, dp=None)
    ]
    assert len(records.records(sel)) == 2  # both sequence-parallel shards
    with pytest.raises(AmbiguousLayerError, match="^router.logits at iteration 4 has layers 0-1: pass layer=$"):
        records.rebuild("router.logits", 4)
    with pytest.raises(InvalidArgumentError, match="rebuilt for one data-parallel rank"):
        records.rebuild(sel.output, 4, layer=1, dp=None)
    with pytest.raises(StoreError, match=f"reads run '{W.RUN}', not 'other'"):
        records.records(TensorSelection("other", "router.logits", 4, layer=1))


def test_runs_are_named_as_the_chdb_reader_names_them(resumed, tmp_path):
    with pytest.raises(StoreError, match=f"no run 'nope' in {resumed} \\(runs: {W.RUN}\\)"):
        open_spool_run(resumed, "nope")
    os.makedirs(tmp_path / "spool")
    with pytest.raises(StoreError, match="holds no runs"):
        open_spool_run(str(tmp_path))


def test_a_parquet_segment_that_does_not_verify_is_refused(tmp_path):
    store = str(tmp_path)
    recs = W.moe_records()
    W.write_spool(store, recs, [W.run_info()])
    (seg,) = [s for s in list_segments(os.path.join(store, "spool")) if s.kind == "tensors"]
    meta = pq.ParquetFile(seg.path).metadata
    chunk = meta.row_group(0).column(meta.schema.names.index("iteration"))
    with open(seg.path, "r+b") as f:  # a key byte, caught by its page CRC (a payload's is its record's CRC)
        f.seek((chunk.dictionary_page_offset or chunk.data_page_offset) + chunk.total_compressed_size - 1)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))
    run = open_spool_run(store)
    with pytest.raises(StoreError, match=f"^spool segment failed verification: {seg.path}: cannot read"):
        run.read_records()


def test_a_record_failing_its_checksum_is_left_out_and_its_iteration_named(tmp_path):
    store = str(tmp_path)
    recs = W.moe_records()
    W.write_spool(store, recs, [W.run_info()])
    bad = records_to_table([recs[0]])  # router.logits iteration 1 layer 0, tokens 0-4 of 8
    bad = bad.set_column(bad.schema.get_field_index("checksum"), "checksum", pa.array([1], pa.uint32()))
    path = SpoolWriter(os.path.join(store, "spool"), 0, W.RUN).write("tensors", bad)
    records = open_spool_run(store).read_records(output=["router.logits"])
    name = os.path.relpath(path, os.path.join(store, "spool"))
    assert records.damaged == {
        ("train", 1): f"a record in spool segment {name} failed verification (payload CRC mismatch)"
    }
    assert records.rebuild("router.logits", 1, layer=0).shape == (
        8,
        4,
    )  # its verified copy (the first segment) rebuilds
    assert not open_spool_run(store).read_records(output=["router.expert_counts"]).damaged  # not what was read
