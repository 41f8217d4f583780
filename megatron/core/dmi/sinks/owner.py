"""One run per store: the process that writes a rank's spool folder holds an exclusive ``flock``
beside it, with who it is written inside, so a second run on the same ``--dmi-store-dir`` is
refused at start-up instead of deleting or overwriting the first run's open segments.
"""

from __future__ import annotations

import os
import socket
import threading
import time

from megatron.core.dmi.errors import DMIError
from megatron.core.dmi.store.backend import take_pid_lock


class StoreInUseError(DMIError, RuntimeError):
    """Another live process writes this rank's spool folder (a second run on the same
    ``--dmi-store-dir``). Raised at start-up, before anything is written; the training entry turns
    it into a one-line exit without a traceback."""


_owned: dict[str, list] = {}  # rank folder -> [lock fd, users] held by this process
_owned_lock = threading.Lock()


def claim_rank_dir(folder: str, run_id: str) -> None:
    """Make this process the one writer of ``folder`` for as long as it holds the claim (another
    process's spool writer would delete or overwrite our open segments); StoreInUseError names
    the holder. Claims by one process nest (``release_rank_dir`` once per claim)."""
    folder = os.path.realpath(folder)
    with _owned_lock:
        if folder in _owned:
            _owned[folder][1] += 1
            return
        os.makedirs(folder, exist_ok=True)
        # Beside the folder, not in it: the folder empties as the ingester consumes it.
        lock = os.path.join(os.path.dirname(folder), f".{os.path.basename(folder)}.owner.lock")
        store = os.path.dirname(os.path.dirname(folder))
        fd = take_pid_lock(
            lock,
            lambda holder: (
                f"--dmi-store-dir {store} is in use by another DMI run ({holder}); two runs cannot share "
                f"a store directory: give this run its own --dmi-store-dir, or wait for that run to end"
            ),
            holder=f"pid {os.getpid()} on {socket.gethostname()}, run {run_id or '?'}, since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
            error=StoreInUseError,
            unknown="unknown process",
        )
        _owned[folder] = [fd, 1]


def release_rank_dir(folder: str) -> None:
    """Give up one claim on a rank's spool folder; the last one drops the lock."""
    folder = os.path.realpath(folder)
    with _owned_lock:
        held = _owned.get(folder)
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            del _owned[folder]
            os.close(held[0])  # drops the flock
