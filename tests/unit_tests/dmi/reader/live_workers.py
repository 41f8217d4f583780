"""Functions the live-read tests run in fresh processes (chDB: one store per process)."""

from __future__ import annotations

import os
import time


def _wait_for(path: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def hold_ingester(store_dir: str, ready: str, stop: str) -> dict:
    """A training run's ingester process: owns the store, loads the spool every 0.2 s until ``stop`` exists."""
    from megatron.core.dmi.store.ingester import IngesterProcess

    ing = IngesterProcess(store_dir, poll_s=0.2).start()
    with open(ready + ".tmp", "w") as f:
        f.write("owner" if ing.owner else "not owner")
    os.replace(ready + ".tmp", ready)  # the test reads it as soon as it exists
    _wait_for(stop)
    ing.finish()
    return {"owner": ing.owner, "records": ing.result.records, "errors": ing.result.errors}


def hold_reader(store_dir: str, ready: str, stop: str) -> int:
    """A reader that keeps a store open (e.g. a notebook) until ``stop`` exists."""
    from megatron.core.dmi.reader import open_store

    with open_store(store_dir) as store:
        n = int(store.runs()["records"].sum())
        open(ready, "w").close()
        _wait_for(stop)
    return n


def records_seen(store_dir: str) -> int:
    from megatron.core.dmi.reader import open_store

    with open_store(store_dir) as store:
        runs = store.runs()
        return int(runs["records"].sum()) if not runs.empty else 0


def ingest_all(store_dir: str) -> dict:
    """What a training run's ingester process does at start and at the end."""
    from megatron.core.dmi.store.ingester import IngesterProcess

    ing = IngesterProcess(store_dir).start()
    ing.finish()
    return {"owner": ing.owner, "records": ing.result.records}


def hold_reader_store(store_dir: str, ready: str, stop: str) -> None:
    """A process that holds the store itself (e.g. a `load`), not as an ingester, until ``stop`` exists."""
    from megatron.core.dmi.store.backend import ChdbBackend

    b = ChdbBackend(os.path.join(store_dir, "chdb"))
    b.ensure_schema()
    open(ready, "w").close()
    _wait_for(stop)
    b.close()
