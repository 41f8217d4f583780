"""SIGTERM and SIGINT mid-training (issue 33, item 4): real pretrain_gpt.py runs of the tiny MoE in
CPU mode, signalled once the log shows iterations ran; the run must seal what DMI captured, print
the report, end with 128 + the signal's number, and every record it captured must be in the store
(read back in its own process) or accounted in the report.

Every run captures ``router`` (4 outputs) on 2 layers x 2 microbatches: 16 records an iteration,
and is given far more iterations than it gets to run.
"""

import os
import re
import signal
import subprocess
import sys
import threading

import pytest

from tests.fault_tests.test_faults import HERE, read_store, store_count
from tests.functional_tests.launch import free_port, tiny_moe_args

PER_ITER = 4 * 2 * 2
HANG_GUARD = 300  # seconds: only against a hung run; the bound itself is DMI's


class Training:
    """pretrain_gpt.py (through fault_launch.py) running in the background, its output collected."""

    def __init__(self, tmp, args, env=None, nproc=1):
        e = dict(os.environ, PYTHONUNBUFFERED="1")
        e.pop("DMI_CLICKHOUSE_PASSWORD", None)
        e.update(env or {})
        launcher = [sys.executable]
        if nproc > 1:
            launcher += ["-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}"]
        cmd = [*launcher, os.path.join(HERE, "fault_launch.py"), *tiny_moe_args(), "--cpu-dev-mode", *args]
        self.proc = subprocess.Popen(
            cmd, cwd=tmp, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        self.lines: list[str] = []
        self._seen = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.log = os.path.join(tmp, "train.log")

    def _read(self):
        for line in self.proc.stdout:
            with self._seen:
                self.lines.append(line)
                self._seen.notify_all()
        with self._seen:
            self._seen.notify_all()

    def wait_for(self, pattern):
        """Block until a line matches ``pattern`` (the run must not end first)."""
        rx = re.compile(pattern)
        with self._seen:
            ok = self._seen.wait_for(
                lambda: any(rx.search(ln) for ln in self.lines) or self.proc.poll() is not None, HANG_GUARD
            )
        assert ok and any(rx.search(ln) for ln in self.lines), self.output[-4000:]

    def end(self):
        """(returncode, output) once the process has ended."""
        rc = self.proc.wait(HANG_GUARD)
        self._reader.join(HANG_GUARD)
        with open(self.log, "w") as f:
            f.write(self.output)
        return rc, self.output

    @property
    def output(self):
        return "".join(self.lines)


def signal_reports(out, name):
    """Every rank's sealed report: (run id, attempt, captured, written, spooled, dropped) by rank."""
    lines = out.splitlines()
    reports = {}
    for i, line in enumerate(lines):
        m = re.match(rf"DMI report at {name} \(run (\S+) attempt (\d+);", line)
        if m:
            n = re.match(
                r"  rank (\d+): captured (\d+) records .*written (\d+) .*spooled (\d+), dropped (\d+)", lines[i + 1]
            )
            assert n, lines[i : i + 3]
            rank, *counts = map(int, n.groups())
            reports[rank] = (m.group(1), int(m.group(2)), *counts)
    return reports


def signal_report(out, name):
    """Rank 0's sealed report: run id, attempt, captured, written, spooled, dropped."""
    return signal_reports(out, name)[0]


def embedded_args(tmp):
    return ["--train-iters", "10000", "--dmi-hooks", "router", "--dmi-store-dir", os.path.join(tmp, "store")]


def assert_every_captured_record_is_kept(out, store, name):
    """Every record the run captured is in the store, or in the spool that opening the store loads;
    the report's `written` is what the store held before anything was loaded."""
    run_id, attempt, captured, written, spooled, dropped = signal_report(out, name)
    assert captured >= 2 * PER_ITER and dropped == 0, out[-3000:]
    assert written + spooled == captured, out[-3000:]
    assert store_count(store).get(f"{run_id}:{attempt}", 0) == written  # a plain count, nothing loaded
    data, _ = read_store(store)  # opens the store through the reader: the spool is loaded first
    run = data["runs"][run_id]
    assert run["rows_per_attempt"] == {str(attempt): captured}
    assert run["duplicate_visible_keys"] == 0 and run["rebuilt"] == captured
    assert f"spooled = in {os.path.join(store, 'spool')}" in out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_training_seals_reports_and_keeps_every_captured_record(tmp_path, sig):
    run = Training(str(tmp_path), embedded_args(str(tmp_path)))
    run.wait_for(r"iteration\s+3/")
    run.proc.send_signal(sig)
    rc, out = run.end()
    assert rc == 128 + sig, out[-4000:]
    assert f"DMI: {sig.name} received: sealing what DMI captured" in out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-4000:]
    assert_every_captured_record_is_kept(out, str(tmp_path / "store"), sig.name)


def test_a_training_thread_that_does_not_come_back_is_sealed_by_the_watchdog(tmp_path):
    """The training thread stalls outside DMI's safe points (as in a collective whose peer is gone):
    the watchdog seals after a third of the bound, from its own thread, and ends the process."""
    run = Training(
        str(tmp_path),
        embedded_args(str(tmp_path)),
        env={"DMI_FAULT": "stall", "DMI_FAULT_ITER": "3", "DMI_SIGNAL_SEAL_SECONDS": "9"},
    )
    run.wait_for(r"^FAULT stall at iteration 3: captured \d+ records; the training thread stalls")
    run.proc.send_signal(signal.SIGTERM)
    rc, out = run.end()
    assert rc == 128 + signal.SIGTERM, out[-4000:]
    assert "did not finish within" not in out and "Traceback" not in out, out[-4000:]
    captured_at_stall = int(re.search(r"FAULT stall at iteration 3: captured (\d+) records", out).group(1))
    assert signal_report(out, "SIGTERM")[2] == captured_at_stall  # nothing was captured after the stall
    assert_every_captured_record_is_kept(out, str(tmp_path / "store"), "SIGTERM")


def test_sigterm_to_torchrun_seals_every_rank_on_its_own(tmp_path):
    """torchrun forwards SIGTERM to both ranks; each seals its own records without a collective
    (its peer may be gone) and prints its report; opening the store then shows every record of
    both ranks once. torchrun's own exit (a SignalException of the agent) is torchrun's."""
    store = str(tmp_path / "store")
    run = Training(str(tmp_path), [*embedded_args(str(tmp_path)), "--global-batch-size", "8"], nproc=2)
    run.wait_for(r"iteration\s+3/")
    run.proc.send_signal(signal.SIGTERM)
    rc, out = run.end()
    assert rc != 0, out[-4000:]
    reports = signal_reports(out, "SIGTERM")
    assert sorted(reports) == [0, 1], out[-4000:]
    assert len({(r[0], r[1]) for r in reports.values()}) == 1  # one run, one attempt
    for _, _, captured, written, spooled, dropped in reports.values():
        assert captured >= 2 * PER_ITER and written + spooled == captured and dropped == 0, out[-4000:]
    run_id, attempt = reports[0][:2]
    data, _ = read_store(store)
    assert data["runs"][run_id]["rows_per_attempt"] == {str(attempt): sum(r[2] for r in reports.values())}
    assert data["runs"][run_id]["duplicate_visible_keys"] == 0


def test_megatron_exit_signal_handler_keeps_sigterm_and_dmi_closes_on_its_path(tmp_path):
    """With --exit-signal-handler Megatron owns SIGTERM: it ends the loop after the step, exits 0
    through its own path, and DMI closes there with its ordinary end-of-run report."""
    from tests.fault_tests.test_faults import assert_written_is_what_the_store_holds

    run = Training(str(tmp_path), [*embedded_args(str(tmp_path)), "--exit-signal-handler"])
    run.wait_for(r"iteration\s+3/")
    run.proc.send_signal(signal.SIGTERM)
    rc, out = run.end()
    assert rc == 0, out[-4000:]
    assert "exiting program after receiving SIGTERM" in out and "DMI: SIGTERM received" not in out
    assert "DMI end-of-run report" in out and "Traceback" not in out, out[-4000:]
    assert_written_is_what_the_store_holds(out, str(tmp_path / "store"))


def test_a_bad_seal_bound_is_a_one_line_startup_error(tmp_path):
    run = Training(str(tmp_path), embedded_args(str(tmp_path)), env={"DMI_SIGNAL_SEAL_SECONDS": "soon"})
    rc, out = run.end()
    assert rc == 1, out[-3000:]
    assert "error: $DMI_SIGNAL_SEAL_SECONDS='soon' is not a number of seconds > 0" in out
    assert "Traceback" not in out and not re.search(r"iteration\s+1/", out)
