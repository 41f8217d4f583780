"""A Parquet spool segment closes by age too (issue 20): records written once, with no further
write and no flush, reach a complete segment that a live reader (and the ingester) can see."""

import time

from megatron.core.dmi.key import ParallelCoords
from megatron.core.dmi.sinks import SpoolSink
from megatron.core.dmi.store.segments import list_segments, read_segment
from tests.unit_tests.dmi.sinks import workers as W


def test_buffered_records_reach_a_segment_without_a_flush(tmp_path):
    recs = W.moe_records()
    sink = SpoolSink(W.RUN, ParallelCoords(rank=0), str(tmp_path), writers=1, segment_seconds=0.2)
    sink.write(recs)
    deadline = time.monotonic() + 60
    while not list_segments(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    segs = [s for s in list_segments(str(tmp_path)) if s.kind == "tensors"]
    assert len(segs) == 1 and read_segment(segs[0]).num_rows == len(recs)
    assert sink._unwritten() == (0, 0)
    sink.close()
    assert sink.report.records_written == len(recs)
