"""``megatron-dmi doctor``: probe this machine for what Megatron-DMI needs.

Prints one line per check, ``ok``, ``warn`` or ``fail``, each ``warn``/``fail`` with its fix, and
exits non-zero when any check fails::

    megatron-dmi doctor                       # versions, compilers, chDB round trip
    megatron-dmi doctor --check-cuda          # a GPU is required (fail without one)
    megatron-dmi doctor --build               # also JIT-build the native ring now
    megatron-dmi doctor --store ./dmi_store   # an existing embedded store
    megatron-dmi doctor --clickhouse-url http://host:8123   # a server: reach + rights

Also registers ``megatron-dmi hooks [--markdown]``, which prints the hook catalog
(``--markdown``: the table of docs/hooks.md, generated from megatron/core/dmi/catalog.py).

chDB lets one process open one store, so every check that opens a store runs in a subprocess.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import stat
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

from megatron.core.dmi.cli.common import add_subcommand

PINNED_MEGATRON_CORE = "0.17.1"
MIN_PYTHON = (3, 12)
MIN_TORCH = (2, 6)
STATUSES = ("ok", "warn", "fail")


@dataclass
class Check:
    """One doctor finding: what was checked, ok/warn/fail, what was seen and how to fix it."""

    name: str
    status: str  # ok | warn | fail
    detail: str
    fix: str = ""

    def line(self) -> str:
        """The finding as one printed line, with its fix appended when the status is not ok."""
        s = f"{self.status:<4}  {self.name:<22} {self.detail}"
        if self.status != "ok" and self.fix:
            s += f"  -> fix: {self.fix}"
        return s


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


# -- individual checks (each returns one or more Check) ---------------------------------------
def check_python() -> Check:
    """The Python version against the minimum DMI needs."""
    v = sys.version.split()[0]
    if sys.version_info[:2] >= MIN_PYTHON:
        return Check("python", "ok", f"{v} ({sys.executable})")
    return Check(
        "python",
        "fail",
        f"{v}: megatron-dmi needs Python >= {'.'.join(map(str, MIN_PYTHON))}",
        "create the venv with python3.12 or newer (see docs/install.md)",
    )


def check_torch() -> Check:
    """Whether torch imports, and its version."""
    try:
        import torch
    except ImportError as e:
        return Check("torch", "fail", f"not importable ({e})", "pip install torch (see docs/install.md)")
    v = torch.__version__
    cuda = torch.version.cuda or "cpu-only build"
    if _version_tuple(v)[:2] < MIN_TORCH:
        return Check(
            "torch",
            "fail",
            f"{v} (CUDA {cuda}): megatron-dmi needs torch >= {'.'.join(map(str, MIN_TORCH))}",
            "pip install -U torch",
        )
    return Check("torch", "ok", f"{v} (CUDA {cuda})")


def check_megatron_core() -> list[Check]:
    """The installed megatron-core against the version DMI is pinned to."""
    try:
        v = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return [Check("megatron-core", "fail", "not installed", f"pip install megatron-core=={PINNED_MEGATRON_CORE}")]
    out = []
    if v != PINNED_MEGATRON_CORE:
        out.append(
            Check(
                "megatron-core",
                "fail",
                f"{v}; DMI's hooks and entry script are written for {PINNED_MEGATRON_CORE} exactly",
                f"pip install megatron-core=={PINNED_MEGATRON_CORE}",
            )
        )
    else:
        out.append(Check("megatron-core", "ok", v))
    try:
        with warnings.catch_warnings():  # megatron.core's import-time notices about TE/apex
            warnings.simplefilter("ignore")
            from megatron.core.datasets import helpers_cpp  # noqa: F401

        out.append(
            Check(
                "dataset helpers",
                "ok",
                f"megatron.core.datasets.helpers_cpp ({os.path.basename(helpers_cpp.__file__)})",
            )
        )
    except ImportError as e:
        out.append(
            Check(
                "dataset helpers",
                "fail",
                f"megatron.core.datasets.helpers_cpp does not import ({e})",
                f"reinstall the wheel: pip install --force-reinstall megatron-core=={PINNED_MEGATRON_CORE} "
                "(it ships the prebuilt module; the wheel has no Makefile to build it)",
            )
        )
    try:
        import yaml  # noqa: F401

        out.append(Check("pyyaml", "ok", metadata.version("PyYAML")))
    except ImportError:
        out.append(
            Check("pyyaml", "fail", "megatron.training imports yaml but it is not installed", "pip install PyYAML")
        )
    return out


def check_cuda(require: bool) -> list[Check]:
    """The CUDA devices torch sees (a failure only where ``require`` is set)."""
    import torch

    if not torch.cuda.is_available():
        why = "torch is a CPU-only build" if torch.version.cuda is None else "no CUDA device visible"
        if require:
            return [
                Check("cuda", "fail", why, "install a CUDA build of torch and check nvidia-smi / CUDA_VISIBLE_DEVICES")
            ]
        return [
            Check(
                "cuda",
                "warn",
                f"{why}: only --cpu-dev-mode training works here",
                "run on a GPU machine (add --check-cuda there to make this a failure)",
            )
        ]
    n = torch.cuda.device_count()
    caps = sorted({torch.cuda.get_device_capability(i) for i in range(n)})
    names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
    out = [Check("cuda", "ok", f"{n} device(s): {', '.join(names)}; CUDA runtime {torch.version.cuda}")]
    from megatron.core.dmi.transport import jit

    archs = {a.replace("+PTX", "") for a in jit._arch_list()}
    have = {f"{major}.{minor}" for major, minor in caps}
    missing = sorted(have - archs)
    cap_text = ", ".join(f"sm_{c.replace('.', '')}" for c in sorted(have))
    if missing:
        out.append(
            Check(
                "compute capability",
                "fail" if require else "warn",
                f"{cap_text}, but the native ring builds for {', '.join(sorted(archs))}",
                f'export TORCH_CUDA_ARCH_LIST="{";".join(sorted(have))}" before the first run',
            )
        )
    else:
        out.append(Check("compute capability", "ok", f"{cap_text} (ring built for {', '.join(sorted(archs))})"))
    return out


def check_build_tools(require_cuda: bool) -> list[Check]:
    """The compilers and tools the native ring's JIT build needs."""
    from megatron.core.dmi.transport import jit

    r = jit.build_report()
    out = []
    fallback = "or train with --dmi-transport torch (the pure-PyTorch ring)"
    if r["cxx"]:
        out.append(Check("c++ compiler", "ok", r["cxx"]))
    else:
        out.append(
            Check(
                "c++ compiler",
                "fail",
                f"no {os.environ.get('CXX', 'c++')}/g++/clang++ on PATH: the native ring cannot build or load",
                f"install g++ (apt-get install g++) or set CXX, {fallback}",
            )
        )
    if r["ninja"]:
        out.append(Check("ninja", "ok", "available"))
    else:
        out.append(
            Check(
                "ninja",
                "fail",
                "not found: torch.utils.cpp_extension needs it for the JIT build",
                f"pip install ninja, {fallback}",
            )
        )
    gpu = r["cuda_available"]
    if r["nvcc"]:
        out.append(Check("nvcc", "ok", f"{r['nvcc']} (release {r['nvcc_version'] or '?'})"))
    else:
        status = "fail" if (gpu or require_cuda) else "warn"
        out.append(
            Check(
                "nvcc",
                status,
                "not found (CUDA_HOME unset, no nvcc on PATH): the CUDA ring cannot build",
                f"install the CUDA toolkit and set CUDA_HOME, {fallback}",
            )
        )
    if r.get("error"):
        out.append(Check("native sources", "fail", r["error"], "reinstall megatron-dmi (pip install -e .)"))
        return out
    for kind in ("host", "cuda"):
        e = r[kind]
        if kind == "cuda" and not gpu:
            continue  # without a GPU the host ring runs: a CUDA build is of no use here
        where = os.path.join(r["extensions_dir"], e["name"])
        if e["cached"]:
            out.append(Check(f"jit cache ({kind})", "ok", f"current build cached at {where}"))
        elif e["can_build"]:
            out.append(
                Check(
                    f"jit cache ({kind})",
                    "warn",
                    f"no build for the current sources/torch in {r['extensions_dir']}: the first run builds it "
                    f"({'seconds' if kind == 'host' else 'about a minute'})",
                    "megatron-dmi doctor --build",
                )
            )
        else:
            out.append(
                Check(
                    f"jit cache ({kind})",
                    "warn",
                    "not built and cannot be built here (see above)",
                    "fix the compiler checks above",
                )
            )
    return out


def check_jit_build(which: str) -> list[Check]:
    """A real build (or load of the cached build) of the native ring."""
    import torch

    from megatron.core.dmi.transport import jit

    out = []
    kinds = ["host"]
    if which == "cuda" or (which == "auto" and torch.cuda.is_available()):
        kinds.append("cuda")
    for kind in kinds:
        try:
            if kind == "host":
                jit.load_host()
                t = jit.build_timings()["host"]
            elif torch.cuda.is_available():
                jit.load_cuda()
                t = jit.build_timings()["cuda"]
            else:
                t = jit.compile_cuda_only()
            how = "loaded from cache" if t["cached"] else "built"
            extra = "" if kind == "host" or torch.cuda.is_available() else " (compile only: no GPU to run it)"
            out.append(Check(f"jit build ({kind})", "ok", f"{how} in {t['seconds']:.1f} s{extra}"))
        except jit.NativeBuildError as e:
            msg = str(e).strip().splitlines()
            out.append(
                Check(
                    f"jit build ({kind})",
                    "fail",
                    msg[0][:300] + (" ..." if len(msg) > 1 else ""),
                    'see the compiler output with `python -c "from megatron.core.dmi.transport import jit; '
                    f'jit.load_{kind if torch.cuda.is_available() or kind == "host" else "cuda"}(verbose=True)"`; '
                    "or train with --dmi-transport torch",
                )
            )
    return out


def check_optional() -> list[Check]:
    """Optional packages, and what each adds."""
    out = []
    for mod, label, why in (
        (
            "transformer_engine",
            "transformer engine",
            "optional: without it train with --transformer-impl local "
            "--no-rope-fusion --no-masked-softmax-fusion --no-persist-layer-norm",
        ),
        ("apex", "apex", "optional: megatron-core falls back to its local fused kernels"),
    ):
        if importlib.util.find_spec(mod) is None:
            out.append(Check(label, "warn", "not installed", why))
        else:
            try:
                v = metadata.version({"transformer_engine": "transformer-engine"}.get(mod, mod))
            except metadata.PackageNotFoundError:
                v = "installed"
            out.append(Check(label, "ok", v))
    return out


# -- store checks (in subprocesses: chDB holds one store per process) -------------------------
def _subprocess(code: str, *args: str, timeout: float = 180) -> tuple[int, dict | None, str]:
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )
    result = None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("DOCTOR_RESULT "):
            result = json.loads(line[len("DOCTOR_RESULT ") :])
            break
    return proc.returncode, result, (proc.stderr or proc.stdout).strip()


_ROUNDTRIP = r"""
import json, os, sys
import torch
from megatron.core.dmi.key import ParallelCoords, RecordKey
from megatron.core.dmi.records import Record, dtype_name, tensor_to_payload
from megatron.core.dmi.sinks import RunInfo, StoreSink
from megatron.core.dmi.reader import open_store
store_dir = sys.argv[1]
coords = ParallelCoords()
t = torch.arange(24, dtype=torch.float32).reshape(6, 4) / 7
key = RecordKey("doctor", "train", 1, 1, 0, 0, 0, "router.logits", coords, 0, 1, 0, 6, 6, dtype_name(t.dtype), tuple(t.shape))
sink = StoreSink(store_dir, "doctor", coords, is_ingester=True)
sink.write_run(RunInfo(run_id="doctor", attempt=1, resumed_from_iteration=None, config={}, versions={},
                       coords=coords, layers=[0], world_size=1))
sink.write([Record(key, tensor_to_payload(t))])
rep = sink.close()
with open_store(store_dir) as s:
    back = s.tensor("doctor", "router.logits", 1, layer=0)
    n = int(s.sql("SELECT count() AS n FROM " + s.t("tensors")).column("n")[0].as_py())
import chdb
print("DOCTOR_RESULT " + json.dumps({"equal": bool(torch.equal(back, t)), "records": n, "written": rep.records_written,
                                     "errors": rep.errors, "chdb": getattr(chdb, "__version__", "?")}))
"""


def check_chdb() -> list[Check]:
    """Whether chDB imports and round-trips a record through an embedded store."""
    try:
        import chdb

        v = getattr(chdb, "__version__", None) or metadata.version("chdb")
    except ImportError as e:
        return [Check("chdb", "fail", f"not importable ({e})", "pip install 'chdb>=4.4'")]
    out = [Check("chdb", "ok", f"{v}")]
    with tempfile.TemporaryDirectory(prefix="dmi-doctor-") as tmp:
        try:
            rc, res, err = _subprocess(_ROUNDTRIP, os.path.join(tmp, "store"))
        except subprocess.TimeoutExpired:
            rc, res, err = -1, None, "timed out after 180 s"
        if rc == 0 and res and res["equal"] and res["records"] == 1:
            out.append(
                Check("chdb round trip", "ok", "spool -> ingest -> embedded store -> reader: 1 record, bitwise equal")
            )
        else:
            detail = (
                f"record read back differs ({res})" if res else (err.splitlines()[-1] if err else f"exit code {rc}")
            )
            out.append(
                Check(
                    "chdb round trip",
                    "fail",
                    f"write/read in a temporary store failed: {detail[:400]}",
                    "pip install --force-reinstall 'chdb>=4.4'; check that the temp directory is writable "
                    "(TMPDIR) and not full",
                )
            )
    return out


_STORE_PROBE = r"""
import json, sys
from megatron.core.dmi.reader import open_store
with open_store(sys.argv[1], database=sys.argv[2], ingest=False) as s:
    runs = s.runs()
print("DOCTOR_RESULT " + json.dumps({"runs": int(len(runs))}))
"""


def check_store(path: str, database: str) -> list[Check]:
    """The store directory at ``path``: whether a run can use it, and spool segments waiting in it."""
    out = []
    path = os.path.abspath(path)
    if not os.path.exists(path):
        parent = os.path.dirname(path)
        if os.access(parent, os.W_OK):
            return [Check("store dir", "ok", f"{path} does not exist yet; a run creates it (mode 0700)")]
        return [
            Check(
                "store dir",
                "fail",
                f"{path} does not exist and {parent} is not writable",
                "choose a writable --dmi-store-dir",
            )
        ]
    if not os.path.isdir(path):
        return [Check("store dir", "fail", f"{path} is not a directory", "point --dmi-store-dir at a directory")]
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if not os.access(path, os.W_OK | os.X_OK):
        out.append(Check("store dir", "fail", f"{path} is not writable by this user", f"chown/chmod {path}"))
    elif mode & 0o077:
        out.append(
            Check(
                "store dir",
                "warn",
                f"{path} has mode {mode:04o}: other users can read captured tensors",
                f"chmod 700 {path}",
            )
        )
    else:
        out.append(Check("store dir", "ok", f"{path} (mode {mode:04o})"))
    spool = os.path.join(path, "spool")
    if os.path.isdir(spool):
        from megatron.core.dmi.store.segments import list_segments

        segs = list_segments(spool)
        corrupt = [f for _, _, fs in os.walk(spool) for f in fs if f.endswith(".corrupt")]
        if corrupt:
            out.append(
                Check(
                    "spool",
                    "warn",
                    f"{len(segs)} segment(s) waiting, {len(corrupt)} quarantined as *.corrupt",
                    f"inspect or delete {spool}/rank-*/*.corrupt (their records could not be read)",
                )
            )
        else:
            out.append(Check("spool", "ok", f"{len(segs)} segment(s) waiting to be ingested"))
    lock = os.path.join(path, "chdb.lock")
    if os.path.exists(lock):
        import fcntl

        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            busy = None
        except BlockingIOError:
            busy = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        finally:
            os.close(fd)
        if busy is not None:
            out.append(
                Check(
                    "store lock",
                    "warn",
                    f"held by pid {busy} (a running training's ingester or a `load`)",
                    "readers work beside it (they read a snapshot); a `load` into it waits for it to finish",
                )
            )
    if os.path.isdir(os.path.join(path, "chdb")):
        try:
            rc, res, err = _subprocess(_STORE_PROBE, path, database)
        except subprocess.TimeoutExpired:
            rc, res, err = -1, None, "timed out"
        if rc == 0 and res is not None:
            out.append(Check("store open", "ok", f"schema current, {res['runs']} run(s)"))
        else:
            last = err.splitlines()[-1] if err else f"exit code {rc}"
            out.append(
                Check(
                    "store open",
                    "fail",
                    last[:400],
                    "see docs/troubleshooting.md (schema version, busy store, permissions)",
                )
            )
    else:
        out.append(
            Check(
                "store open",
                "ok" if not os.listdir(path) or os.path.isdir(spool) else "warn",
                "no embedded store (chdb/) yet",
                "is this a --dmi-store-dir? it holds chdb/ and spool/",
            )
        )
    return out


def check_server(url: str, database: str, password_file: str | None) -> list[Check]:
    """Whether a ClickHouse server at ``url`` is reachable, and DMI's schema and permissions in ``database``."""
    from megatron.core.dmi.store import schema as S
    from megatron.core.dmi.store.backend import BackendError, ServerBackend
    from megatron.core.dmi.store_address import (
        IdentifierError,
        ServerURLError,
        check_database,
        parse_server_url,
        resolve_password,
    )

    try:
        parse_server_url(url)
        check_database(database)
    except (ServerURLError, IdentifierError) as e:
        return [Check("clickhouse url", "fail", str(e), "use http(s)://[user@]host:port and a plain database name")]
    try:
        password = resolve_password(None, password_file)
    except OSError as e:
        return [
            Check(
                "clickhouse password",
                "fail",
                f"cannot read the password file ({e.strerror})",
                "check --password-file / DMI_CLICKHOUSE_PASSWORD_FILE",
            )
        ]
    backend = ServerBackend(url, database, password, connect_timeout=3.0, send_receive_timeout=20.0)
    out = []
    try:
        try:
            version = backend.query_arrow("SELECT version() AS v").column("v")[0].as_py()
        except BackendError as e:
            return [
                Check(
                    "clickhouse server",
                    "fail",
                    f"{backend.description} unreachable: {backend.redact(str(e))[:300]}",
                    "start the server or fix the URL/firewall; meanwhile train with --dmi-persist spool and "
                    "load the spool later (megatron-dmi load)",
                )
            ]
        out.append(Check("clickhouse server", "ok", f"{backend.description}, version {version}"))
        try:
            backend.ensure_schema()
            out.append(
                Check(
                    "clickhouse schema",
                    "ok",
                    f"database {database}: DMI tables present (schema version {S.SCHEMA_VERSION})",
                )
            )
        except S.SchemaVersionError as e:
            return out + [Check("clickhouse schema", "fail", str(e), "use another --dmi-clickhouse-database")]
        except BackendError as e:
            return out + [
                Check(
                    "clickhouse schema",
                    "fail",
                    f"cannot create the DMI tables: {backend.redact(str(e))[:300]}",
                    f"GRANT CREATE DATABASE, CREATE TABLE, CREATE VIEW, INSERT, SELECT ON {database}.* to this user",
                )
            ]
        probe = S.qualified(database, "dmi_doctor_probe")
        try:
            backend.command(f"CREATE TABLE IF NOT EXISTS {probe} (x UInt8) ENGINE = Memory")
            import pyarrow as pa

            backend.insert_arrow("dmi_doctor_probe", pa.table({"x": pa.array([1], pa.uint8())}))
            n = backend.query_arrow(f"SELECT count() AS n FROM {probe}").column("n")[0].as_py()
            backend.command(f"DROP TABLE IF EXISTS {probe}")
            out.append(Check("clickhouse permissions", "ok", f"create/insert/select/drop in {database} work ({n} row)"))
        except BackendError as e:
            out.append(
                Check(
                    "clickhouse permissions",
                    "fail",
                    f"insert/select in {database} failed: {backend.redact(str(e))[:300]}",
                    f"GRANT INSERT, SELECT, CREATE TABLE, DROP TABLE ON {database}.* to this user",
                )
            )
    finally:
        backend.close()
    return out


# -- the command ---------------------------------------------------------------------------------
def run_checks(args: argparse.Namespace) -> list[Check]:
    """Every check the arguments ask for, in order (a check that raises is reported as failed)."""
    checks: list[Check] = []

    def add(fn: Callable, *a) -> None:
        try:
            r = fn(*a)
        except Exception as e:  # a probe itself broke: report it as a failure, never a traceback
            r = Check(
                fn.__name__.replace("check_", ""),
                "fail",
                f"check crashed: {type(e).__name__}: {e}",
                "report this with the output of `megatron-dmi doctor`",
            )
        checks.extend(r if isinstance(r, list) else [r])

    add(check_python)
    add(check_torch)
    add(check_megatron_core)
    add(check_cuda, args.check_cuda)
    add(check_build_tools, args.check_cuda)
    if args.build:
        add(check_jit_build, args.build)
    add(check_optional)
    add(check_chdb)
    if args.store:
        add(check_store, args.store, args.database)
    if args.clickhouse_url:
        add(check_server, args.clickhouse_url, args.database, args.password_file)
    return checks


def cmd_doctor(args: argparse.Namespace) -> int:
    """``doctor``: print each check; returns 1 if any failed."""
    checks: list[Check] = []
    for c in run_checks(args):
        checks.append(c)
        print(c.line(), flush=True)
    counts = {s: sum(c.status == s for c in checks) for s in STATUSES}
    print(f"doctor: {counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail")
    return 1 if counts["fail"] else 0


def _setup_doctor(p: argparse.ArgumentParser) -> None:
    p.add_argument("--check-cuda", action="store_true", help="require a usable GPU and CUDA toolkit (fail without)")
    p.add_argument(
        "--build",
        nargs="?",
        const="auto",
        default=None,
        choices=("auto", "host", "cuda"),
        help="JIT-build the native ring now: host; cuda too when a GPU is visible (auto), or compile the "
        "CUDA ring without a GPU (cuda)",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--store", default=None, help="an embedded store directory (--dmi-store-dir) to check")
    where.add_argument("--clickhouse-url", default=None, help="a ClickHouse server http(s)://[user@]host:port to check")
    p.add_argument("--database", default="dmi", help="database name (default: dmi)")
    p.add_argument(
        "--password-file", default=None, help="file holding the ClickHouse password (default: $DMI_CLICKHOUSE_PASSWORD)"
    )
    p.set_defaults(func=cmd_doctor)


def cmd_hooks(args: argparse.Namespace) -> int:
    """``hooks``: print the catalog of capturable outputs and their groups."""
    from megatron.core.dmi import catalog

    if args.markdown:
        print(catalog.markdown_table())
        return 0
    print(f"{'output':<22} {'group':<7} {'local shape':<26} {'dtype':<13} opt-in")
    for o in catalog.OUTPUTS:
        print(f"{o.name:<22} {o.group:<7} {o.shape:<26} {o.dtype:<13} {catalog.opt_in_text(o)}")
    print("groups: " + ", ".join(f"{g} = {','.join(v)}" for g, v in catalog.GROUPS.items()) + "; also all, none")
    return 0


def _setup_hooks(p: argparse.ArgumentParser) -> None:
    p.add_argument("--markdown", action="store_true", help="print the markdown table of docs/hooks.md")
    p.set_defaults(func=cmd_hooks)


add_subcommand("doctor", _setup_doctor, "check this machine: versions, compilers, GPU, chDB, a store or server")
add_subcommand("hooks", _setup_hooks, "the hook catalog (--markdown: the table in docs/hooks.md)")
