"""SignalSeal's bound and chaining, in a real process receiving a real signal (the whole training
run's seal is in tests/fault_tests/test_signals.py). Its ``close`` here is the caller's callable,
which is what SignalSeal is given in the runtime too."""

import os
import signal
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))


def _start(body: str) -> subprocess.Popen:
    script = textwrap.dedent(
        """
        import signal, sys, threading, time
        from megatron.training.dmi.signals import SignalSeal
        """
    ) + textwrap.dedent(body)
    p = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert p.stdout.readline().strip() == "ready", p.communicate()
    return p


def test_a_seal_that_does_not_finish_within_the_bound_is_cut_with_one_line():
    p = _start(
        """
        seal = SignalSeal(threading.Event().wait, 1.5)  # a close that never returns (a sink on a dead disk)
        seal.install([signal.SIGTERM])
        print("ready", flush=True)
        while True:
            seal.at_safe_point()
            time.sleep(0.01)
        """
    )
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "DMI: SIGTERM received: sealing what DMI captured" in err
    assert (
        "DMI: sealing after SIGTERM did not finish within 1.5 s ($DMI_SIGNAL_SEAL_SECONDS); exiting without it" in err
    )


def test_a_previous_handler_is_chained_and_decides_the_end():
    p = _start(
        """
        def previous(signum, frame):
            print("previous handler ran", flush=True)

        signal.signal(signal.SIGTERM, previous)
        seal = SignalSeal(lambda: print("sealed", flush=True), 30)
        seal.install([signal.SIGTERM])
        print("ready", flush=True)
        while seal.signum is None:
            time.sleep(0.01)
        seal.at_safe_point()
        print("still running after the seal", flush=True)
        seal.close_once()  # a later close (atexit) does nothing more
        """
    )
    p.send_signal(signal.SIGTERM)
    out = p.stdout.read()
    assert p.wait(120) == 0, p.stderr.read()
    assert out.splitlines() == ["previous handler ran", "sealed", "still running after the seal"], out


def test_an_ignored_signal_stays_ignored():
    p = _start(
        """
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        seal = SignalSeal(lambda: print("sealed", flush=True), 30)
        seal.install([signal.SIGINT])
        print("ready", flush=True)
        print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN, flush=True)
        """
    )
    out = p.stdout.read()  # what follows "ready" (communicate would miss what readline buffered)
    assert p.wait(120) == 0 and out.strip() == "True", out
