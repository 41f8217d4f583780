"""What a DMI training process does on SIGTERM (a scheduler's time limit or preemption) and SIGINT
(Ctrl-C): seal what DMI captured, say what is where, end the process, all within a bounded time.

Megatron's ``--exit-signal-handler`` owns its ``--exit-signal`` (SIGTERM by default): Megatron then
saves a checkpoint and leaves the training loop, and DMI closes on that normal path, so DMI leaves
that signal alone. For every other case a Python handler of DMI's is installed (never over an
ignored signal).

Why a flag and a safe point, not the work in the handler: Python runs a handler on the main thread
between two bytecodes of whatever it interrupted, which may be DMI's own code holding one of the
sink's locks (``write_drops`` runs on the training thread); closing the sink from there would wait
on that lock forever. So the handler only notes the signal and starts a watchdog thread. The
training thread seals at its next *safe point*, a place where it holds no DMI lock: the start of a
forward, the log interval, a checkpoint save, the end of the loop or DMI's close (``at_safe_point``).
When it does not get there within a third of the bound (stuck in a collective whose peer is gone, a
long checkpoint write), the watchdog seals from a thread of its own: the training thread is then
running other code, so any DMI lock it takes is let go again, and capture is stopped first so the
report is not outrun. Whoever seals, the process ends when the bound is up: with the report when the
seal finished, else with one line saying it did not (what is not sealed is what the seal had not
written yet; the segments written before are whole).

The seal is ``DMISession.seal``: this rank only, no collectives (torchrun sends the signal to every
rank and each seals its own sink; a peer may already be gone).

The process then ends as the signal asked: exit status 128 + the signal's number (143, 130), without
Python's clean-up (atexit, ``finally`` blocks of the interrupted code), as the default action would.
A Python handler that was installed before DMI's (another library's) is chained: it runs right
after DMI's notes the signal, and decides the process's fate itself; DMI still seals.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable

SEAL_SECONDS_ENV = "DMI_SIGNAL_SEAL_SECONDS"
DEFAULT_SEAL_SECONDS = 30.0


def seal_seconds() -> float:
    """The bound on sealing after a signal: ``$DMI_SIGNAL_SEAL_SECONDS``, default 30; SystemExit
    with one line when it is not a number of seconds > 0."""
    raw = os.environ.get(SEAL_SECONDS_ENV, "").strip()
    if not raw:
        return DEFAULT_SEAL_SECONDS
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise SystemExit(
            f"error: ${SEAL_SECONDS_ENV}={raw!r} is not a number of seconds > 0 "
            f"(the bound on sealing DMI's records after SIGTERM/SIGINT; default {DEFAULT_SEAL_SECONDS:g})"
        )
    return seconds


def handled_signals(exit_signal_handler: bool, exit_signal: int) -> list[int]:
    """SIGTERM and SIGINT, less the signal Megatron's ``--exit-signal-handler`` owns."""
    owned = int(exit_signal) if exit_signal_handler else None
    return [s for s in (signal.SIGTERM, signal.SIGINT) if int(s) != owned]


def _say(line: str) -> None:
    """One line on stderr by a plain write: safe in a signal handler and on any thread (``print``
    may be inside the very buffered write the handler interrupted)."""
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


def _end(signum: int) -> None:
    """End the process as the signal's default action would, but with the output flushed."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream must not keep the process alive
            pass
    os._exit(128 + signum)


class SignalSeal:
    """DMI's handling of SIGTERM/SIGINT for one training process.

    ``close`` is the runtime's close: called once, by the first of the training thread (at a safe
    point or DMI's normal close) and the watchdog's seal thread; it knows from ``signum`` whether it
    seals (a signal came) or closes normally. ``seconds``: the bound, from the signal to the end.
    """

    def __init__(self, close: Callable[[], None], seconds: float):
        """Nothing is installed until ``install``."""
        self._close = close
        self.seconds = seconds
        self.signum: int | None = None
        self._since = 0.0
        self._previous: dict[int, object] = {}
        self._claim = threading.Lock()  # taken once, never given back: one close per process
        self._started = threading.Event()
        self._done = threading.Event()

    @property
    def signal_name(self) -> str:
        """The name of the signal received (``SIGTERM``), or '' before one."""
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def install(self, signums: Iterable[int]) -> None:
        """Handle each of ``signums`` (main thread only), unless the process ignores it."""
        for signum in signums:
            previous = signal.getsignal(signum)
            if previous in (signal.SIG_IGN, None):  # ignored, or set from C: leave it to its owner
                continue
            self._previous[signum] = previous
            signal.signal(signum, self._on_signal)

    def _restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers; the process ends anyway
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, previous)

    def _chained(self, signum: int) -> Callable | None:
        previous = self._previous.get(signum)
        if callable(previous) and previous is not signal.default_int_handler:
            return previous
        return None  # the default action (SIGINT's is Python's KeyboardInterrupt): DMI ends the process

    def _on_signal(self, signum: int, frame) -> None:
        """Note the signal and start the watchdog; nothing that takes a lock."""
        name = signal.Signals(signum).name
        if self.signum is not None:  # torchrun follows Ctrl-C with SIGTERM; a user presses it twice
            _say(
                f"DMI: {name} while sealing after {self.signal_name}: the seal goes on (bounded by {self.seconds:g} s)"
            )
            return
        self.signum, self._since = signum, time.monotonic()
        _say(
            f"DMI: {name} received: sealing what DMI captured, then exiting "
            f"(at most {self.seconds:g} s, ${SEAL_SECONDS_ENV})"
        )
        threading.Thread(target=self._watch, name="dmi-signal-watchdog", daemon=True).start()
        chained = self._chained(signum)
        if chained is not None:
            chained(signum, frame)

    def at_safe_point(self) -> None:
        """The training thread holds no DMI lock here: seal now if a signal came."""
        if self.signum is not None:
            self.close_once()

    def close_once(self) -> None:
        """Run ``close`` unless another thread already does (then wait for it to end the process);
        after a signal, end the process when done (unless a chained handler decides)."""
        if not self._claim.acquire(blocking=False):
            self._done.wait()
            return
        self._started.set()
        try:
            self._close()
        except Exception as exc:
            if self.signum is None:
                raise
            _say(f"DMI: sealing after {self.signal_name} failed: {exc!r}")
        finally:
            self._done.set()
            self._restore()
        if self.signum is not None and self._chained(self.signum) is None:
            _end(self.signum)

    def elapsed(self) -> float:
        """Seconds since the signal."""
        return time.monotonic() - self._since

    def _watch(self) -> None:
        if not self._started.wait(self.seconds / 3) and not self._claim.locked():
            threading.Thread(target=self.close_once, name="dmi-signal-seal", daemon=True).start()
        if not self._done.wait(max(0.0, self.seconds - self.elapsed())):
            _say(
                f"DMI: sealing after {self.signal_name} did not finish within {self.seconds:g} s "
                f"(${SEAL_SECONDS_ENV}); exiting without it: spool segments written before are whole, "
                "the open one and what the drain still held are lost"
            )
            os._exit(128 + self.signum)
