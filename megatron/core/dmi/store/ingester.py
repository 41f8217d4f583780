"""The per-node ingester, a process of its own: training processes only spool, and this process
loads every rank's closed spool segments into the store: the embedded chDB store, which it owns, or
a ClickHouse server (``--clickhouse-url``), into which it makes several inserts at once.

Two ends:

* ``serve`` runs in the ingester process (``megatron-dmi ingest STORE [--follow]``). It opens the
  store, or stands down when another process holds it (the chDB store's lock, or for a server the
  spool's ``ingester.lock``: that process ingests every rank folder, ours included). Then it makes a
  pass (``ingest_spool``: verified, read back, loaded segments deleted) whenever it is woken and at
  least every ``poll_s`` seconds, until it is told to finish, its control stream ends or its parent
  dies; then a final pass, and it exits. A server it cannot reach, or that refuses or loses inserts,
  is retried with back-off while the segments wait in the spool. After every pass it publishes its
  status: one JSON line on stdout (for the training process that started it) and
  ``<store>/ingester.json`` (for anyone else: ``watch``, a later run on the same store).
* ``IngesterProcess`` runs in local rank 0's training process. It starts the ingester at a lower
  CPU priority with a bounded number of threads (chDB's, or parallel inserts into a server), wakes it
  when a segment closes, keeps its latest status, restarts it when it dies, and at the end asks for
  the final pass and waits.

Why a process: inserting and verifying take whole cores and hold the GIL in stretches; inside a
training process they compete with a host-bound step's kernel launches.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from megatron.core.dmi.errors import DMIError
from megatron.core.dmi.store import schema as S
from megatron.core.dmi.store.backend import (
    Backend,
    BackendError,
    ChdbBackend,
    ServerBackend,
    StoreBusyError,
    take_pid_lock,
)
from megatron.core.dmi.store.ingest import IngestResult, ingest_spool, known_segment_ids
from megatron.core.dmi.store.segments import list_segments
from megatron.core.dmi.store_address import PASSWORD_ENV

log = logging.getLogger("megatron.core.dmi.sinks")

STATUS_FILE = "ingester.json"  # in the store folder, beside chdb/ and spool/
SPOOL_LOCK = "ingester.lock"  # in the store folder: a server's ingester holds it (chDB's store has its own lock)
RETRY_S = (5.0, 60.0)  # a server that fails a pass is tried again after 5 s, doubling up to 60 s
EXIT_STANDING_DOWN = 3  # another process holds the store
MAX_RESTARTS = 3  # an ingester that keeps dying is left dead; the spool keeps the records
TEST_RENAME_ENV = "DMI_TEST_RENAME_TENSORS"  # test-only: see _Service._test_rename_tensors
SYNC_WORD = re.compile(r"sync (\d+)( close)?")
CLOSING_TRIES = 3  # passes a closing sync gives segments that a pass left in the spool


def default_ingest_threads() -> int:
    """The ingester's threads (the embedded store's chDB threads, or parallel inserts into a server): a quarter of
    the cores, 1 to 4. Each keeps about one of the ingester's cores busy, and the training keeps the rest."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


class IngesterError(DMIError, RuntimeError):
    """The ingester process cannot be started (e.g. no Python to run it)."""


# ------------------------------------------------------------------------------------------------
# The ingester process
# ------------------------------------------------------------------------------------------------


@dataclass
class IngesterStatus:
    """What the ingester publishes after every pass (stdout line and ``<store>/ingester.json``)."""

    pid: int
    host: str
    state: str  # "ingesting", "finishing", "done", "standing down"
    owner: bool
    started: float  # wall clock (time.time())
    holder: str = ""  # standing down: who holds the store
    error: str = ""  # state "failed": why the store could not be opened
    passes: int = 0
    last_pass: float = 0.0
    waiting_segments: int = 0  # spool segments left after the last pass
    waiting_bytes: int = 0
    oldest_waiting: float = 0.0  # mtime of the oldest segment left (0: none)
    synced: int = 0  # the last ``sync <n>`` answered: this status follows a pass made after it
    complete_at: float = 0.0  # a pass after a sync or the final one left no segment in the spool then
    result: dict = field(default_factory=dict)  # IngestResult.to_dict(), cumulative
    credited_waiting: list[str] = field(default_factory=list)  # verified in the store, file not yet retired

    def to_json(self) -> str:
        """One line of JSON."""
        return json.dumps(self.__dict__, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> IngesterStatus:
        """The status a line (or the status file) holds."""
        return cls(**json.loads(text))


def read_status(store_dir: str) -> IngesterStatus | None:
    """The last status the store's ingester published, or None (no ingester wrote one, or unreadable)."""
    try:
        with open(os.path.join(store_dir, STATUS_FILE), encoding="utf-8") as f:
            return IngesterStatus.from_json(f.read())
    except (OSError, ValueError, TypeError):
        return None


def live_ingester(store_dir: str) -> IngesterStatus | None:
    """The status of the ingester holding the store now: its last status says it owns the store and has not
    ended, and its process runs on this host; None otherwise."""
    s = read_status(store_dir)
    if s is None or not s.owner or s.state == "done" or s.host != socket.gethostname():
        return None
    try:
        os.kill(s.pid, 0)
    except ProcessLookupError:  # killed: its status file outlived it
        return None
    except PermissionError:  # another user's process: it runs
        pass
    return s


class _Control:
    """The ingester's control stream: lines ``wake``, ``sync <n>`` (a pass now, then a status that says
    ``synced: n``), ``sync <n> close`` (the same, for the run's report: see ``serve``) and ``final``; the
    stream's end means final too."""

    def __init__(self, stream):
        self.fd = stream.fileno() if stream is not None else None
        self._buf = b""

    def wait(self, timeout: float) -> str | None:
        """The next word (``"wake"``, ``"sync <n>"``, ``"final"``), or None when ``timeout`` passed."""
        if self.fd is None:
            time.sleep(timeout)
            return None
        deadline = time.monotonic() + timeout
        while True:
            if b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                word = line.strip().decode(errors="replace")
                if word in ("wake", "final") or SYNC_WORD.fullmatch(word):
                    return word
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(self.fd, 4096)
            if not chunk:  # the training process closed it, or died
                self.fd = None
                return "final"
            self._buf += chunk


class _Service:
    """The store-owning side of ``serve``: the backend, the segment ids it knows, and its status. For a server:
    whether it is reachable, and when to try it again."""

    def __init__(self, store_dir: str, database: str, threads: int, codec: str | None, url: str | None = None):
        self.store_dir = store_dir
        self.spool_root = os.path.join(store_dir, "spool")
        self.codec = codec
        self.url = url
        self.result = IngestResult()
        self.known: set[str] = set()
        self.credited: set[str] = set()
        self.connected = False
        self.retry_s = RETRY_S[0]
        self.retry_at = 0.0  # monotonic time of the next try, after a failed one
        self.paused = False
        self.renamed = False  # the test-only rename fault fired
        self.left: set[str] = set()  # ids of the segments the last pass took and did not load
        self.held: set[str] = set()  # ids left by the closing sync, which later passes leave alone
        self._lock_fd: int | None = None
        self.backend: Backend
        self.streams: int  # batches ``ingest_spool`` inserts at once (``Backend.use_threads``)
        if url:
            self._lock_fd = _lock_spool(store_dir)  # StoreBusyError: stand down
            self.backend = ServerBackend(url, database)  # the password: $DMI_CLICKHOUSE_PASSWORD (from the supervisor)
            self.streams = self.backend.use_threads(threads)  # parallel inserts, each its own request
            self.connect()  # an unreachable server is retried at the next passes
        else:
            self.backend = ChdbBackend(os.path.join(store_dir, "chdb"), database)  # StoreBusyError: stand down
            try:
                self.backend.ensure_schema(codec)  # a new store's payload codec; an existing one keeps its own
                # chDB's query and insert pools, and the streams of each insert: the training keeps the other cores
                self.streams = self.backend.use_threads(threads)
                self.known = known_segment_ids(self.backend)
            except BaseException:
                self.backend.close()
                raise
            self.connected = True
        self.status = IngesterStatus(os.getpid(), socket.gethostname(), "ingesting", True, time.time())

    def connect(self) -> bool:
        """(Re)connect to the server: its tables (created with our codec if missing, a wrong schema version
        raised) and the segment ids it holds. False, with the outage noted and the next try scheduled, when it
        cannot be reached or refuses."""
        try:
            self.backend.ensure_schema(self.codec)
            self.known = known_segment_ids(self.backend)
        except BackendError as e:
            self.failed(f"{e}")
            return False
        if self.retry_at:
            log.warning("DMI ingester: ClickHouse %s answers again; loading the spool", self.backend.description)
        self.connected = True
        return True

    def failed(self, why: str) -> None:
        """A server pass that did not load everything it took, ``why`` (naming the server): noted (logged at the
        first of an outage), and the next try waits (``RETRY_S``, doubling)."""
        msg = f"{why}; segments wait in {self.spool_root} and are retried"
        if not self.retry_at:
            log.warning("DMI ingester: %s after %.0f s, then up to every %.0f s", msg, self.retry_s, RETRY_S[1])
        if msg not in self.result.errors:
            self.result.errors.append(msg[:2000])
        self.retry_at = time.monotonic() + self.retry_s
        self.retry_s = min(RETRY_S[1], self.retry_s * 2)

    def run_pass(self, forced: bool = False) -> None:
        """A pass over the spool, then the status. A server in back-off after a failed pass is left alone until
        its next try is due, unless ``forced`` (a sync, the final pass)."""
        if self.url and (forced or time.monotonic() >= self.retry_at):
            self._server_pass()
        elif not self.url:
            self._test_rename_tensors()
            r, broke = self._ingest()
            if broke is not None:  # one failed pass must not end the ingester; the next retries
                r.note(f"ingest pass failed: {type(broke).__name__}: {broke}")
            self._add(r)
        self.credited -= self.known  # recorded in dmi.segments, so retired: nothing left to say about them
        left = list_segments(self.spool_root)
        s = self.status
        s.passes += 1
        s.last_pass = time.time()
        s.waiting_segments = len(left)
        s.waiting_bytes = sum(seg.size for seg in left)
        s.oldest_waiting = min((_mtime(seg.path) for seg in left), default=0.0)
        s.result = self.result.to_dict()
        s.credited_waiting = sorted(self.credited)

    def _server_pass(self) -> None:
        if not self.connected and not self.connect():
            return
        self._test_rename_tensors()
        r, broke = self._ingest()
        self._add(r)
        if broke is not None or r.segments_unverified:
            self.connected = broke is None  # unreachable: the next try checks the tables again
            if isinstance(broke, BackendError):
                self.failed(str(broke))
            elif broke is not None:
                self.failed(
                    f"ingest pass into ClickHouse {self.backend.description} failed: {type(broke).__name__}: {broke}"
                )
            else:
                self.failed(
                    f"ClickHouse {self.backend.description} did not take {r.segments_unverified} spool segment(s) in "
                    "a pass (see the errors before)"
                )
        elif self.retry_at:
            self.retry_at, self.retry_s = 0.0, RETRY_S[0]

    def _ingest(self) -> tuple[IngestResult, Exception | None]:
        """A pass of ``ingest_spool``, and the error that ended it early (None: it ran through); ``left`` becomes
        what it took and did not load."""
        self.left = left = set()
        try:
            r = ingest_spool(
                self.backend,
                self.spool_root,
                delete=True,
                known=self.known,
                credited=self.credited,
                streams=self.streams,
                hold=self.held,
                left=left,
            )
            return r, None
        except Exception as e:  # last resort: the caller says what it means
            return IngestResult(), e

    def _add(self, r: IngestResult) -> None:
        self.result.add(r)
        if r.paused and not self.paused:  # loud once per episode; the status and the report carry it too
            log.warning("DMI ingester: %s", r.paused)
        elif self.paused and not r.paused:
            log.warning("DMI ingester: ingest resumed: the store's file system has room again")
        self.paused = bool(r.paused)

    def _test_rename_tensors(self) -> None:
        """Test-only (tests/fault_tests/test_faults.py): once the file ``$DMI_TEST_RENAME_TENSORS`` names
        exists, rename the tensors table away, as someone working on the store by hand might: the
        inserts after it fail. Never set in real runs."""
        flag = os.environ.get(TEST_RENAME_ENV)
        if not flag or self.renamed or not os.path.exists(flag):
            return
        self.renamed = True
        db = self.backend.database
        n = self.backend.query_arrow(f"SELECT count() AS n FROM {db}.tensors").column("n")[0].as_py()
        self.backend.command(f"RENAME TABLE {db}.tensors TO {db}.tensors_moved")
        print(f"FAULT: tensors table held {n} records; renamed it to {db}.tensors_moved", file=sys.stderr, flush=True)

    def publish(self, out) -> None:
        line = self.status.to_json()
        _write_status_file(self.store_dir, line)
        if out is not None:
            try:
                out.write(line + "\n")
                out.flush()
            except (BrokenPipeError, ValueError):  # the training process is gone; the file still says it
                pass

    def close_sync(self) -> None:
        """After the pass of a closing sync, which the run's report is settled from: give what it left up to
        ``CLOSING_TRIES`` passes in all while the store takes inserts, then hold back what is still left, so the
        store holds what the report says (those segments wait in the spool for a later ingester or ``load``)."""
        for _ in range(CLOSING_TRIES - 1):
            if not self.left or self.paused or not self.connected:
                break
            self.run_pass(forced=True)
        self.held |= self.left

    def close(self) -> None:
        self.backend.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # drops the flock


def _lock_spool(store_dir: str) -> int:
    """Make this process the one ingester of the store folder's spool (another one would delete segments this
    one reads); StoreBusyError names the holder's pid. Returns the lock's file descriptor."""
    os.makedirs(store_dir, exist_ok=True)
    return take_pid_lock(
        os.path.join(store_dir, SPOOL_LOCK),
        lambda holder: (
            f"the spool of {store_dir} is ingested by another process (pid {holder}), which loads it into its store"
        ),
    )


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def _write_status_file(store_dir: str, line: str) -> None:
    path = os.path.join(store_dir, STATUS_FILE)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(line + "\n")
        os.replace(tmp, path)  # readers see the old status or the new one, never half
    except OSError as e:  # a full disk: the status is a convenience, the store and spool are what count
        log.warning("DMI ingester: cannot write %s: %s", path, e)


def serve(
    store_dir: str,
    *,
    database: str = S.DEFAULT_DATABASE,
    follow: bool = False,
    poll_s: float = 2.0,
    threads: int | None = None,
    nice: int = 0,
    codec: str | None = None,
    url: str | None = None,
    control=None,
    out=None,
    interrupt_finishes: bool = False,
) -> int:
    """The ingester process's main loop (see the module's docstring); returns its exit status: 0, or
    ``EXIT_STANDING_DOWN`` when another process holds the store. ``url``: the ClickHouse server to load the
    spool into, with ``threads`` parallel inserts (None: the embedded store under ``store_dir``, with ``threads``
    chDB threads; ``threads`` None: ``default_ingest_threads()``); ``control``: the stream of ``wake`` / ``sync <n>`` /
    ``final`` lines (None: poll only); ``out``: where status lines go (None: the status file only);
    ``codec``: the payload codec of a store created now (``schema.PAYLOAD_CODECS``; None: the default);
    ``interrupt_finishes``: Ctrl-C ends ``follow`` with a final pass (by hand) instead of being ignored
    (a training's ingester: the training tells it to finish). Call it on the main thread."""
    if nice:
        os.nice(nice)
    finishing = threading.Event()

    def finish(*_):  # SIGTERM (a scheduler's) or Ctrl-C by hand: end with a final pass, not mid-insert
        finishing.set()

    signal.signal(signal.SIGTERM, finish)
    signal.signal(signal.SIGINT, finish if interrupt_finishes else signal.SIG_IGN)
    try:
        svc = _Service(store_dir, database, threads or default_ingest_threads(), codec, url)
    except StoreBusyError as e:
        standing = IngesterStatus(os.getpid(), socket.gethostname(), "standing down", False, time.time(), str(e))
        if out is not None:
            out.write(standing.to_json() + "\n")
            out.flush()
        return EXIT_STANDING_DOWN
    except Exception as e:  # last resort (e.g. a full disk at schema creation): say why, for the report
        failed = IngesterStatus(os.getpid(), socket.gethostname(), "failed", False, time.time())
        failed.error = f"cannot open the store {store_dir}: {type(e).__name__}: {e}"
        if out is not None:
            out.write(failed.to_json() + "\n")
            out.flush()
        raise
    parent = os.getppid()
    ctl = _Control(control)
    sync = 0
    try:
        svc.publish(out)  # owner from now on
        last = not follow
        forced = last  # a sync's pass and the final one do not wait for a server's back-off
        closing = False
        while True:
            svc.run_pass(forced)
            if closing:
                svc.close_sync()
            if sync or last:  # a pass the training waits for: say whether it left the spool empty
                svc.status.synced = sync
                svc.status.complete_at = time.time() if svc.status.waiting_segments == 0 else 0.0
            if last:
                break
            svc.publish(out)
            word = ctl.wait(poll_s)
            last = word == "final" or finishing.is_set() or os.getppid() != parent
            forced, closing = last, False
            if word and SYNC_WORD.fullmatch(word):
                sync = int(SYNC_WORD.fullmatch(word).group(1))
                forced, closing = True, bool(SYNC_WORD.fullmatch(word).group(2))
        svc.status.state = "done"
        svc.publish(out)
    finally:
        svc.close()
    return 0


# ------------------------------------------------------------------------------------------------
# The training process's handle on it
# ------------------------------------------------------------------------------------------------


class IngesterProcess:
    """Starts and supervises the node's ingester process for a training run (local rank 0)."""

    def __init__(
        self,
        store_dir: str,
        database: str = S.DEFAULT_DATABASE,
        *,
        poll_s: float = 2.0,
        threads: int | None = None,
        nice: int = 10,
        codec: str | None = None,
        url: str | None = None,
        password: str | None = None,
    ):
        """An ingester of the spool under ``store_dir`` (``start`` launches it): a pass every ``poll_s``
        seconds or when woken, at CPU priority ``nice`` (added to ours), into the embedded store under
        ``store_dir`` with ``threads`` chDB threads or, with ``url``, into that ClickHouse server with
        ``threads`` parallel inserts (None: ``default_ingest_threads()``; its ``password`` reaches the process in its environment, never its
        arguments); a store it creates gets payload codec ``codec`` (None: the default)."""
        self.store_dir = store_dir
        self.database = database
        self.poll_s = poll_s
        self.threads = threads or default_ingest_threads()
        self.url = url
        self.password = password
        self.nice = nice
        self.codec = codec
        self.restarts = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._status: IngesterStatus | None = None
        self._earlier = IngestResult()  # what ingesters of this run that have ended did
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._finishing = False
        self._known_owner = threading.Event()  # set once the process says whether it owns the store
        self._changed = threading.Event()  # a new status arrived, or the process ended
        self._sync = 0  # the last ``sync`` ticket sent

    # -- life ----------------------------------------------------------------------------------
    def start(self) -> IngesterProcess:
        """Launch the ingester (returns at once; it opens the store on its own); returns self."""
        os.makedirs(self.store_dir, exist_ok=True)  # a run's store may not exist before its first segment
        self._launch(follow=True)
        return self

    def _launch(self, follow: bool) -> None:
        cmd = [
            sys.executable,
            "-m",
            "megatron_dmi",
            "ingest",
            self.store_dir,
            "--database",
            self.database,
            "--poll-seconds",
            str(self.poll_s),
            "--nice",
            str(self.nice),
        ]
        cmd += ["--threads", str(self.threads)] + (["--clickhouse-url", self.url] if self.url else [])
        cmd += ["--codec", self.codec] if self.codec else []
        # --control: status lines on stdout (a one-pass ingester's too: what it loads joins the report)
        cmd += ["--control", "stdin"] + (["--follow"] if follow else [])
        try:
            # its own session: a terminal's Ctrl-C or a kill of the training's process group does not
            # cut an insert short; it learns of the end from its control stream
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                start_new_session=True,
                env=_child_env(self.password),
            )
        except OSError as e:
            raise IngesterError(f"cannot start the DMI ingester ({' '.join(cmd[:4])} ...): {e}") from e
        self._proc = proc
        self._reader = threading.Thread(target=self._read, args=(proc,), name="dmi-ingester-status", daemon=True)
        self._reader.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            try:
                status = IngesterStatus.from_json(line)
            except (ValueError, TypeError):
                continue
            with self._lock:
                self._status = status
            self._known_owner.set()
            self._changed.set()
            if status.state == "standing down":
                log.warning(
                    "DMI: not ingesting on this node: %s. That process loads this run's spool segments; "
                    "the end-of-run report says what it had loaded",
                    status.holder,
                )
        rc = proc.wait()
        self._known_owner.set()
        self._changed.set()
        with self._lock:
            status = self._status
            if status is not None and status.owner:
                self._earlier.add(IngestResult.from_dict(status.result))
                self._status = IngesterStatus(**{**status.__dict__, "result": {}, "credited_waiting": []})
            finishing = self._finishing
        if rc == EXIT_STANDING_DOWN or (finishing and rc == 0):
            return
        what = f"died (exit status {rc})" if rc else "ended"
        if status is not None and status.error:
            what += f": {status.error[:500]}"
        if finishing:
            log.error("DMI: the ingester process (pid %d) %s during its final pass", proc.pid, what)
            self._note(f"the ingester process {what} during its final pass; what it did not load waits in the spool")
        elif self.restarts < MAX_RESTARTS:
            self.restarts += 1
            log.error(
                "DMI: the ingester process (pid %d) %s; training goes on spooling; restarting it (%d of %d)",
                proc.pid,
                what,
                self.restarts,
                MAX_RESTARTS,
            )
            self._note(f"the ingester process {what} during the run and was restarted")
            self._launch(follow=True)
        else:
            log.error(
                "DMI: the ingester process (pid %d) %s again; training goes on spooling, and the records wait in the "
                "spool for the final pass or `megatron-dmi ingest`",
                proc.pid,
                what,
            )
            self._note(f"the ingester process {what} {MAX_RESTARTS + 1} times; it was not restarted again")

    def _note(self, msg: str) -> None:
        with self._lock:
            if msg not in self.errors:
                self.errors.append(msg)

    # -- what it says ----------------------------------------------------------------------------
    @property
    def status(self) -> IngesterStatus | None:
        """The latest status the ingester published (None before its first)."""
        with self._lock:
            return self._status

    @property
    def owner(self) -> bool:
        """Whether our ingester holds the store (waits up to 60 s for it to say, at the first ask)."""
        self._known_owner.wait(60)
        s = self.status
        return bool(s and s.owner)

    @property
    def result(self) -> IngestResult:
        """Everything this run's ingesters did, cumulative, with the supervisor's own errors."""
        with self._lock:
            r = IngestResult()
            r.add(self._earlier)
            if self._status is not None and self._status.result:
                r.add(IngestResult.from_dict(self._status.result))
            for e in self.errors:
                if e not in r.errors:
                    r.errors.append(e)
            return r

    @property
    def credited(self) -> set[str]:
        """Ids of segments whose records the store holds (read back) that are not yet retired."""
        s = self.status
        return set(s.credited_waiting) if s else set()

    def alive(self) -> bool:
        """Whether an ingester process is running now."""
        return self._proc is not None and self._proc.poll() is None

    # -- control ---------------------------------------------------------------------------------
    def wake(self) -> None:
        """Ask for a pass now rather than at the next poll (never blocks)."""
        self._say(b"wake\n")

    def _say(self, word: bytes) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None or proc.poll() is not None:
            return
        try:
            os.set_blocking(proc.stdin.fileno(), False)
            os.write(proc.stdin.fileno(), word)
        except (BlockingIOError, BrokenPipeError, OSError, ValueError):  # full pipe: a pass is due anyway
            pass

    def sync(self, closing: bool = True) -> IngestResult:
        """A pass now, and wait for it. ``closing``: every rank's sink is closed, so it loads all they
        spooled, and from here on a dead ingester is not restarted (one pass in a fresh one stands in); the
        report is settled from this pass, so the ingester gives what the pass could not load a few more tries,
        then leaves it in the spool for good (``_Service.close_sync``). Returns what this run's ingesters did."""
        self._known_owner.wait(60)  # a run shorter than the ingester's start: let it say whether it stands down
        with self._lock:
            self._finishing = self._finishing or closing
            standing_down = self._status is not None and self._status.state == "standing down"
            self._sync += 1
            ticket = self._sync
        if standing_down:
            return self.result
        self._say(f"sync {ticket}{' close' if closing else ''}\n".encode())
        since = time.monotonic()
        while not self._synced(ticket) and self.alive():
            self._changed.wait(30)
            if not self._synced(ticket) and time.monotonic() - since >= 30:
                s = self.status
                log.warning(
                    "DMI: waiting %.0f s for the ingester to load the spool (%s segment(s) left after its last pass)",
                    time.monotonic() - since,
                    s.waiting_segments if s else "?",
                )
        if not self._synced(ticket):  # it died (or was never up): one pass in a fresh one
            self._one_pass()
        return self.result

    def _synced(self, ticket: int) -> bool:
        with self._lock:
            self._changed.clear()
            return self._status is not None and self._status.synced >= ticket

    def finish(self) -> IngestResult:
        """Ask for the final pass and wait for the ingester to end (it closes the store); one pass in a
        fresh ingester if it is not running."""
        self._known_owner.wait(60)
        with self._lock:
            self._finishing = True
            standing_down = self._status is not None and self._status.state == "standing down"
        if standing_down:
            return self.result
        if self.alive():
            self._say(b"final\n")
            self._wait_exit()
        else:
            self._one_pass()
        return self.result

    def _one_pass(self) -> None:
        self._wait_exit()  # the reader of the ingester that ended has folded its result in
        self._launch(follow=False)
        self._wait_exit()

    def _wait_exit(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.stdin is not None:
            try:
                proc.stdin.close()  # the end of the control stream: final, for an ingester that missed the word
            except OSError:
                pass
        proc.wait()
        if self._reader is not None:
            self._reader.join()


def _child_env(password: str | None) -> dict:
    """The training's environment for the ingester, minus what would make it a torch.distributed rank, plus the
    server's ``password`` where one is given (the training may have read it from a file)."""
    env = dict(os.environ)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    if password:
        env[PASSWORD_ENV] = password
    return env
