"""Reading a store whose file system is full (issue 33, item 4): the reader's snapshot needs room
there, so a finished store is read in place and anything else gets one line (CLI exit 1, a
DiskFullError from the API), never a traceback.

The disk is a real tmpfs filled to the last byte (root only, as the fault tests' disk faults; the
test skips otherwise): the failures are the kernel's own ENOSPC, nothing injected.
"""

import fcntl
import os

import pytest

from tests.fault_tests.tmpfs import fill, small_tmpfs
from tests.unit_tests.dmi.isolated import run_isolated
from tests.unit_tests.dmi.sinks import workers as W


@pytest.fixture
def full_disk(tmp_path):
    """A 48 MiB tmpfs (room for the store's 16 MiB free-space margin while it is written)."""
    mount = str(tmp_path / "disk")
    with small_tmpfs(mount, "48m") as why:
        if why:
            pytest.skip(why)
        yield mount


def _files(store):
    return sorted(os.path.relpath(os.path.join(r, f), store) for r, _, fs in os.walk(store) for f in fs)


def test_a_finished_store_on_a_full_disk_is_read_in_place(full_disk):
    store = os.path.join(full_disk, "store")
    records = W.moe_records(iterations=range(1, 4), attempt=1, seed=0)
    run_isolated(W.write_embedded, store, records, [W.run_info(attempt=1)])
    late = W.moe_records(iterations=range(4, 5), attempt=1, seed=1)
    run_isolated(W.write_spool, store, late)  # a segment the store has not loaded (a crash's leftover)
    fill(full_disk)
    before = _files(store)

    rc, out = run_isolated(W.load_cli, ["show", store])
    assert rc == 0, out
    assert f"(the file system of {store} is full: read in place, no snapshot taken and nothing loaded)" in out
    assert W.RUN in out and "Traceback" not in out
    rc, out = run_isolated(W.load_cli, ["watch", "--once", store])
    assert rc == 0 and "iterations 1..3" in out, out
    rc, err = run_isolated(W.cli_stderr, ["show", store])
    assert rc == 0 and "read in place, without the 1 spool segment(s) not loaded into it yet" in err, err

    d = run_isolated(W.store_call, store, "describe", W.RUN)  # the API: every record the store holds
    assert d.records == len(records) and d.iterations == {"train": [1, 2, 3]}
    assert _files(store) == before  # no snapshot left behind, the spool segment still waiting


def test_a_live_store_on_a_full_disk_is_one_line(full_disk):
    """The run's ingester holds the store (its lock file, as the training process takes it): no
    snapshot can be made and the store cannot be opened beside its writer."""
    store = os.path.join(full_disk, "store")
    run_isolated(W.write_embedded, store, W.moe_records(iterations=range(1, 3)), [W.run_info()])
    fill(full_disk)
    fd = os.open(os.path.join(store, "chdb.lock"), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        rc, err = run_isolated(W.cli_stderr, ["watch", "--once", store])
        kind, msg = run_isolated(W.open_store_error, store)
    finally:
        os.close(fd)
    assert rc == 1, err
    assert err.startswith(f"error: cannot read {store} while its run writes it: the file system of {store} is full")
    assert "No space left on device" in err and len(err.strip().splitlines()) == 1, err
    assert kind == "DiskFullError" and "while its run writes it" in msg


def test_a_spool_only_store_on_a_full_disk_is_one_line(full_disk):
    store = os.path.join(full_disk, "store")
    run_isolated(W.write_spool, store, W.moe_records(iterations=range(1, 3)), [W.run_info()])
    fill(full_disk)
    rc, err = run_isolated(W.cli_stderr, ["show", store])
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert "its spool has to be loaded into a snapshot there to be read" in err and "megatron-dmi load" in err
    assert not os.path.exists(os.path.join(store, ".readers"))
