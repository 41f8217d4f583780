"""Launch pretrain_gpt.py with one fault injected at the start of a training iteration.

    DMI_FAULT=<kind> DMI_FAULT_ITER=<n> python tests/fault_tests/fault_launch.py <pretrain_gpt.py args>

Kinds (each first flushes DMI so that everything captured before iteration n is in the sink, and
prints ``FAULT <kind> at iteration <n>: ...`` with the counts it saw):

- ``rename_tensors``: someone renames the embedded store's tensors table away (``RENAME TABLE
  dmi.tensors TO dmi.tensors_moved``) mid-run, through the session of the process that owns the
  store (chDB lets no other process in); every later insert of the ingester fails.
- ``disk_full``: the file system of the store directory is filled to the last byte (a file of zeros
  in ``$DMI_FAULT_FILL_DIR``), so every later spool segment hits ENOSPC; or, with
  ``$DMI_FAULT_LEAVE_BYTES``, until that much stays free (a nearly full disk).
- ``kill``: ``kill -9`` of this very process (SIGKILL: no atexit, no flush, no report).
- ``stall``: the training thread stops for ``$DMI_FAULT_STALL_SECONDS`` (default 600) outside any of
  DMI's safe points, as one stuck in a collective whose peer is gone (a signal's handler runs, then
  the sleep goes on), so a signal's seal has to come from DMI's watchdog thread.
- ``server_dies``: the ClickHouse server of ``--dmi-clickhouse-url`` (the local test server, with a
  fault armed by the test: ``chdb_server.py``) dies in the ingester's pass over what was flushed; the
  training waits until the test has brought it back (``/ping`` answers), then goes on.
"""

import os
import signal
import sys
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from megatron.training.dmi import pretrain_gpt  # noqa: E402  (its main() prepares the process as a real run)
from megatron.training.dmi import runtime as dmi_runtime  # noqa: E402
from tests.fault_tests.tmpfs import fill  # noqa: E402

KIND = os.environ.get("DMI_FAULT", "")
AT = int(os.environ.get("DMI_FAULT_ITER", "3"))
_fired = False


def _say(msg: str) -> None:
    print(f"FAULT {KIND} at iteration {AT}: {msg}", flush=True)


def _rename_tensors(rt) -> None:
    """The ingester process owns the store: it renames the table itself, at its next pass, once the flag
    file its environment names exists (store/ingester.py, test-only)."""
    ing = rt.session.sink.ingester
    ing.sync(closing=False)  # what was flushed so far is in the store
    open(os.environ["DMI_TEST_RENAME_TENSORS"], "w").close()
    ing.sync(closing=False)  # the pass that renames it
    _say("the ingester renamed the tensors table")


def _disk_full(rt) -> None:
    leave = int(os.environ.get("DMI_FAULT_LEAVE_BYTES", "0"))
    written = fill(os.environ["DMI_FAULT_FILL_DIR"], leave)
    _say(f"filled the file system with {written} bytes" + (f", leaving {leave} free" if leave else ""))


def _kill(rt) -> None:
    _say(f"captured {rt.session.transport.stats.published} records; kill -9 now")
    os.kill(os.getpid(), signal.SIGKILL)


def _stall(rt) -> None:
    seconds = float(os.environ.get("DMI_FAULT_STALL_SECONDS", "600"))
    _say(f"captured {rt.session.transport.stats.published} records; the training thread stalls for {seconds:g} s")
    time.sleep(seconds)


def _server_dies(rt) -> None:
    ing = rt.session.sink.ingester
    ing.sync(closing=False)  # its inserts reach the server, which dies in one of them
    ping = rt.args.dmi_clickhouse_url.split("@")[-1].removeprefix("http://")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://{ping}/ping", timeout=2):
                break
        except OSError:
            time.sleep(0.2)
    _say(f"the ingester's pass left {ing.status.waiting_segments} segment(s) in the spool; the server is back")


FAULTS = {
    "rename_tensors": _rename_tensors,
    "disk_full": _disk_full,
    "kill": _kill,
    "stall": _stall,
    "server_dies": _server_dies,
}
_before_forward = dmi_runtime.DMIRuntime.before_forward


def before_forward(self, model):
    global _fired
    if not _fired and model.training and self.args.curr_iteration + 1 >= AT:
        _fired = True
        self.flush()
        FAULTS[KIND](self)
    return _before_forward(self, model)


if __name__ == "__main__":
    if KIND:
        dmi_runtime.DMIRuntime.before_forward = before_forward
    sys.argv[0] = os.path.join(REPO, "pretrain_gpt.py")
    pretrain_gpt.main()
