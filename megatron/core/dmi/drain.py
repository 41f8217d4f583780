"""The drain: a background thread moving finished records from the transport to the sink.

It is the only consumer of the transport and the only caller of ``Sink.write``, so the training
thread never waits on persistence (except under ``--dmi-on-full block`` when the ring is full).
"""

from __future__ import annotations

import logging
import queue
import threading

import pyarrow as pa

from megatron.core.dmi.records import table_nbytes
from megatron.core.dmi.sinks.base import Sink
from megatron.core.dmi.transport.base import Transport

log = logging.getLogger(__name__)


class Drain:
    """``linger_bytes``: while nothing waits on a flush, each take waits up to ``poll_seconds`` for
    that much payload, so small records leave in few batches: every batch costs a GIL round trip,
    and each one makes the training thread yield the GIL (see NativeRingTransport.take_table).
    Default: 32 MiB or a quarter of the ring, whichever is smaller."""

    def __init__(self, transport: Transport, sink: Sink, batch_records: int = 1024, poll_seconds: float = 0.05,
                 linger_bytes: int | None = None):
        self.transport = transport
        self.sink = sink
        self.batch_records = batch_records
        self.poll_seconds = poll_seconds
        self.linger_bytes = min(32 << 20, transport.ring_bytes // 4) if linger_bytes is None else linger_bytes
        self.records_persisted = 0
        self.bytes_persisted = 0
        self.batches_written = 0
        self.sink_errors: list[str] = []
        self._stop = threading.Event()
        # Flush requests are answered by the drain thread itself: only it takes records, so only it
        # knows when everything taken has also been written.
        self._flush_requests: queue.SimpleQueue[threading.Event] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="dmi-drain", daemon=True)
        self._thread.start()

    def _write(self, table: pa.Table) -> None:
        try:
            self.sink.write_table(table)
            self.records_persisted += table.num_rows
            self.bytes_persisted += table_nbytes(table)
            self.batches_written += 1
        except Exception as exc:  # the sink spools on its own; anything else must not kill training
            msg = f"sink write of {table.num_rows} records failed: {exc!r}"
            log.error("DMI: %s", msg)
            self.sink_errors.append(msg)

    def _answer_flushes(self) -> None:
        while True:
            try:
                self._flush_requests.get_nowait().set()
            except queue.Empty:
                return

    def _run(self) -> None:
        while True:
            urgent = self._stop.is_set() or not self._flush_requests.empty()
            table = self.transport.take_table(self.batch_records, self.poll_seconds, 0 if urgent else self.linger_bytes)
            if table is not None:
                self._write(table)
            if self.transport.pending() == 0:
                if not self._flush_requests.empty():
                    self.sink.flush()
                    self._answer_flushes()
                if self._stop.is_set():
                    return

    @property
    def lag_records(self) -> int:
        """Records captured but not yet handed to the sink."""
        return self.transport.pending()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every record published so far is written to the sink and the sink flushed."""
        self.transport.settle()
        done = threading.Event()
        self._flush_requests.put(done)
        return done.wait(timeout)

    def close(self) -> None:
        self.transport.settle()
        self._stop.set()
        self._thread.join()
        self._answer_flushes()
