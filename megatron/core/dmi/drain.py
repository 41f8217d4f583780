"""The drain: a background thread moving finished records from the transport to the sink.

It is the only consumer of the transport and the only caller of ``Sink.write``, so the training
thread never waits on persistence (except under ``--dmi-on-full block`` when the ring is full).
"""

from __future__ import annotations

import logging
import threading
import time

from megatron.core.dmi.records import Record
from megatron.core.dmi.sinks.base import Sink
from megatron.core.dmi.transport.base import Transport

log = logging.getLogger(__name__)


class Drain:
    def __init__(self, transport: Transport, sink: Sink, batch_records: int = 256, poll_seconds: float = 0.05):
        self.transport = transport
        self.sink = sink
        self.batch_records = batch_records
        self.poll_seconds = poll_seconds
        self.records_persisted = 0
        self.bytes_persisted = 0
        self.sink_errors: list[str] = []
        self._busy = False  # a batch is between transport and sink
        self._stop = threading.Event()
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="dmi-drain", daemon=True)
        self._thread.start()

    def _write(self, records: list[Record]) -> None:
        try:
            self.sink.write(records)
            self.records_persisted += len(records)
            self.bytes_persisted += sum(len(r.payload) for r in records)
        except Exception as exc:  # the sink spools on its own; anything else must not kill training
            msg = f"sink write of {len(records)} records failed: {exc!r}"
            log.error("DMI: %s", msg)
            self.sink_errors.append(msg)

    def _run(self) -> None:
        while True:
            with self._idle:
                self._busy = True
            records = self.transport.take(self.batch_records, self.poll_seconds)
            if records:
                self._write(records)
            with self._idle:
                self._busy = False
                if self.transport.pending() == 0:
                    self._idle.notify_all()
            if self._stop.is_set() and self.transport.pending() == 0:
                return

    @property
    def lag_records(self) -> int:
        """Records captured but not yet handed to the sink."""
        return self.transport.pending()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every record published so far has been written to the sink, then flush it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._busy or self.transport.pending():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._idle.wait(min(0.05, remaining) if remaining else 0.05)
        self.sink.flush()
        return True

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
