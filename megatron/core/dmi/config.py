"""DMIConfig: every DMI setting in one dataclass, built from the --dmi-* flags or directly.

Each field has a type, a default and a docstring: ``megatron/training/dmi/arguments.py`` makes one
``--dmi-<field>`` flag per field from them (the docstring is its help) and copies the parsed values
back by name. A field whose values need more than their type names its parser in its metadata
(``parse``): it takes the flag's text or a typed value (any iterable for a set) and returns the
field's value, or raises a ``ValueError`` subclass saying why. The flag runs it on the text and
``DMIConfig`` on every value it is given, so one function checks a setting wherever it comes from.
``host_check`` (the ring size) asks whether this machine can hold the value: the flag asks at
start-up and the training runtime again once CUDA is up; a config built elsewhere is not asked.
"""

import math
import os
import re
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import Literal, get_args, get_origin

import torch

from megatron.core.dmi.catalog import parse_hooks
from megatron.core.dmi.key import PHASES
from megatron.core.dmi.store_address import (
    PASSWORD_ENV,
    ServerURLError,
    check_database,
    check_store_run,
    parse_server_url,
    redact,
)
from megatron.core.dmi.validators import ConfigValueError, nice_increment, number, positive_int


class CaptureWindowError(ConfigValueError):
    """The last captured iteration comes before the first."""


# The smallest ring accepted: one slot of the native ring (its ``transport.abi.SLOT_ALIGN``; a test
# checks they agree). The ring itself rounds the size down to whole slots.
MIN_RING_BYTES = 256


def ring_size_mb(value: str | float) -> float:
    """The size of a transport's ring.

    Args:
        value: MiB, as the flag's text or a number.

    Returns:
        The size in MiB: finite, and at least ``MIN_RING_BYTES`` (one slot).

    Raises:
        ConfigValueError: not a number, or not a size a ring can have.
    """
    mb = number(value, "a size in MiB")
    if not (math.isfinite(mb) and mb * (1 << 20) >= MIN_RING_BYTES):
        raise ConfigValueError(f"ring size must hold at least one {MIN_RING_BYTES}-byte slot, got {value!r} MiB")
    return mb


def ring_memory_problem(mb: float) -> str | None:
    """Why a ring of ``mb`` MiB cannot be allocated here, or None. Host memory must hold the ring
    and its staging copy (host ring) or the pinned staging copy (CUDA ring); a CUDA ring must also
    fit the device's free memory, known only once CUDA is initialised (never initialised here)."""
    host_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 20)
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's processes on this machine, one ring each
    limit = host_mib / (2 * procs)
    if mb > limit:
        return (
            f"{mb:g} MiB does not fit this machine: the ring and its staging copy of each of its {procs} "
            f"process(es) need twice that in host memory, which is {host_mib:.0f} MiB; use at most {limit:.0f}"
        )
    if torch.cuda.is_initialized():  # never initialise CUDA here (before Megatron sets the device)
        free, _ = torch.cuda.mem_get_info()
        if mb * (1 << 20) > free:
            return (
                f"{mb:g} MiB does not fit the free memory of cuda:{torch.cuda.current_device()}, "
                f"{free / (1 << 20):.0f} MiB"
            )
    return None


# The native rings count the timeout in uint64 nanoseconds; a week is far beyond any useful wait.
MAX_BLOCK_TIMEOUT = 7 * 24 * 3600.0


def block_timeout_seconds(value: str | float) -> float:
    """How long a producer blocked by a full ring waits before it drops its record.

    Args:
        value: seconds, as the flag's text or a number.

    Returns:
        The seconds: above 0, at most ``MAX_BLOCK_TIMEOUT``.

    Raises:
        ConfigValueError: not a number, or out of that range.
    """
    seconds = number(value, "a number of seconds")
    if not 0 < seconds <= MAX_BLOCK_TIMEOUT:
        raise ConfigValueError(f"expected seconds above 0 and at most {MAX_BLOCK_TIMEOUT:.0f} (a week), got {value!r}")
    return seconds


def spool_size_gb(value: str | float) -> float:
    """A bound on the spool's disk use.

    Args:
        value: GiB, as the flag's text or a number.

    Returns:
        The GiB: finite and above 0.

    Raises:
        ConfigValueError: not a number, or not a positive finite size.
    """
    gb = number(value, "a size in GiB")
    if not (math.isfinite(gb) and gb > 0):
        raise ConfigValueError(f"expected a size in GiB above 0, got {value!r}")
    return gb


class SpoolBoundError(ConfigValueError):
    """A spool bound given where no store takes the spool away (``--dmi-persist spool`` or ``none``)."""


def parse_phases(spec: str | Iterable[str]) -> frozenset[str]:
    """The phases captured.

    Args:
        spec: a comma list such as ``train,valid``, or an iterable of phase names.

    Returns:
        The set of phases, at least one, each one of ``PHASES``.

    Raises:
        ConfigValueError: an unknown phase, or none.
    """
    phases = frozenset(p.strip() for p in (spec.split(",") if isinstance(spec, str) else spec))
    unknown = phases - set(PHASES)
    if unknown or not phases:
        raise ConfigValueError(f"unknown phase(s) {sorted(unknown)} in {spec!r} (known: {', '.join(PHASES)})")
    return phases


class LayerRangeError(ConfigValueError):
    """A layer selection (e.g. ``0,4-7``) is malformed, empty or out of range."""


MAX_LAYER = 1 << 16


def parse_layers(spec: str | Iterable[int] | None) -> frozenset[int] | None:
    """``0,4-7`` (or an iterable of layers) -> {0,4,5,6,7}; None or ``all`` -> None (every layer).
    Layers are global, 0-based, below ``MAX_LAYER``."""
    if spec is None or (isinstance(spec, str) and spec.strip() == "all"):
        return None
    if not isinstance(spec, str):
        layers = frozenset(spec)
        for layer in layers:
            if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < MAX_LAYER:
                raise LayerRangeError(f"layer {layer!r} is out of range (0..{MAX_LAYER - 1})")
        return layers
    # Bound every number first: "0-99999999999" must be an error, not a set of 10^11 layers.
    for num in "".join(c if c.isdigit() else " " for c in spec).split():
        if len(num) > 6 or int(num) >= MAX_LAYER:
            raise LayerRangeError(f"layer {num[:12]!r} in {spec[:80]!r} is out of range (0..{MAX_LAYER - 1})")
    layers: set[int] = set()
    for item in (s.strip() for s in spec.split(",")):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise LayerRangeError(f"malformed layer range {item!r} in {spec!r} (expected e.g. 0,4-7)")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise LayerRangeError(f"empty layer range {item!r} in {spec!r} (end before start)")
        layers.update(range(a, b + 1))
    return frozenset(layers)


def check_server_url(url: str) -> str:
    """A ClickHouse server's URL.

    Args:
        url: the URL as given.

    Returns:
        ``url``, once it is a plain ``http(s)://[user@]host:port`` without a password.

    Raises:
        ServerURLError: anything else; the message never echoes a password.
    """
    shown = redact(url, None)  # never echo a user:password@ part back
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:
        raise ServerURLError(f"expected http(s)://host:port, got {shown!r} ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ServerURLError(f"expected http(s)://host:port, got {shown!r}")
    if parts.password is not None:
        raise ServerURLError(f"put the password in ${PASSWORD_ENV} or --dmi-clickhouse-password-file, not in the URL")
    try:
        _ = parts.port  # urllib parses the port lazily: ask for it to validate it
    except ValueError:
        raise ServerURLError(f"bad port in {shown!r}") from None
    try:
        parse_server_url(url)
    except ServerURLError as exc:
        raise ServerURLError(str(exc).removeprefix("--dmi-clickhouse-url ")) from None
    return url


class RunIdError(ConfigValueError):
    """A run id that cannot name a folder under the store."""


# A run id names a folder under the store (attempts/<run id>): one path component that can never be
# ".", "..", hidden or read as an option, and never holds a separator.
_RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_run_id(run_id: str) -> str:
    """``run_id`` if it can name a folder under the store, else raise ``RunIdError``."""
    if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id):
        raise RunIdError(
            f"run id must be 1-128 ASCII letters, digits, '.', '_' or '-', starting with a letter "
            f"or digit, got {str(run_id)[:140]!r}"
        )
    return run_id


def _parsed(default, parse: Callable, **metadata):
    """A field whose values ``parse`` checks (and converts from text); more metadata for the flag."""
    return field(default=default, metadata={"parse": parse, **metadata})


@dataclass
class DMIConfig:
    """Deep Model Inspection: capture model internals while training."""

    hooks: frozenset[str] = _parsed(frozenset(), parse_hooks)
    """comma list of hook groups or outputs (router, attn, router.logits, attn.q, ..., all, none);
    default none: DMI is off"""

    persist: Literal["clickhouse", "spool", "none"] = "clickhouse"
    """clickhouse: embedded chDB under --dmi-store-dir, or a server with --dmi-clickhouse-url; spool:
    local spool segments only (loadable later with `load`); none: capture and transport, store nothing"""

    store_dir: str = "dmi_store"
    """store and spool directory (default: <--save>/dmi_store, else ./dmi_store)"""

    store_codec: Literal["lz4", "zstd1", "none"] = "lz4"
    """payload codec of a store created by this run (embedded or server): lz4 ingests fastest and still
    shrinks compressible payloads; zstd1 stores bf16 activations about a fifth smaller at about 0.6x the
    ingest speed; none. An existing store keeps the codec it was created with (docs/storage.md)"""

    clickhouse_url: str | None = _parsed(None, check_server_url)
    """ClickHouse server http(s)://host:port (password from $DMI_CLICKHOUSE_PASSWORD or the file flag)"""

    clickhouse_database: str = _parsed("dmi", check_database)
    """database name, in the server or the embedded store (letters, digits, '_')"""

    clickhouse_password: str | None = field(default=None, repr=False)
    """the server's password: never a flag (it would sit in argv and in logs); read from
    $DMI_CLICKHOUSE_PASSWORD or --dmi-clickhouse-password-file"""

    ingest_threads: int | None = _parsed(None, positive_int)
    """threads of the node's ingester process: the embedded store's chDB threads, which are also the parallel
    streams of each insert of 128 MiB or more, or with --dmi-clickhouse-url that many parallel inserts into the
    server, each read back (default: a quarter of the cores, 1 to 4; docs/storage.md)"""

    ingest_nice: int = _parsed(10, nice_increment)
    """how much lower the ingester process's CPU priority is than the training's (0-19)"""

    interval: int = _parsed(1, positive_int)
    """capture every N-th iteration"""

    start_iter: int = _parsed(1, positive_int)
    """first captured iteration (1-based)"""

    end_iter: int | None = _parsed(None, positive_int)
    """last captured iteration"""

    layers: frozenset[int] | None = _parsed(None, parse_layers)
    """global 0-based layers, e.g. 0,4-7 (default all)"""

    phases: frozenset[str] = _parsed(frozenset({"train"}), parse_phases)
    """phases captured: train,valid"""

    ring_mb: float = _parsed(64.0, ring_size_mb, host_check=ring_memory_problem)
    """payload ring size per process in MiB"""

    on_full: Literal["block", "drop"] = "block"
    """ring full: block the producer until space frees (for at most --dmi-block-timeout), or drop
    (counted, logged, stored)"""

    block_timeout: float = _parsed(60.0, block_timeout_seconds)
    """seconds a producer blocked by a full ring (--dmi-on-full block) waits for space; then its
    record is dropped and counted as a drop (a stalled drain cannot hang training)"""

    spool_max_gb: float | None = _parsed(None, spool_size_gb)
    """GiB of each rank's spool segments that may wait for the store (ingest, or a server's replay);
    at the bound the drain stops taking records, DMI warns, and the ring's --dmi-on-full policy
    applies until the store catches up (docs/storage.md). Default: no bound. Only with
    --dmi-persist clickhouse: a spool-only run keeps every segment by design"""

    transport: Literal["auto", "native", "torch"] = "auto"
    """native: JIT-built ring kernels; torch: pure-PyTorch ring; auto: native if it builds"""

    record_replays: bool = False
    """keep activation-recompute replays as invocation 1 instead of rejecting them"""

    run_id: str | None = _parsed(None, check_run_id)
    """run id (default: generated; kept on resume)"""

    flush_records: int = _parsed(256, positive_int)
    """most records the drain hands the sink in one batch"""

    logits_topk: int = _parsed(8, positive_int)
    """k of the logits.topk output"""

    replay_routing: str | None = _parsed(None, check_store_run)
    """STORE[@RUN]: route every MoE layer of every training microbatch through the top-k experts that
    run (default: the store's latest) recorded as router.topk_ids; scores stay live (docs/usage.md)"""

    replay_missing: Literal["error", "live"] = "error"
    """an iteration the replayed run holds no routing for: error (stop) or live (route it live, counted)"""

    def __post_init__(self):
        """Check every value with its field's parser (the one its flag ran), keeping what it returns."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if get_origin(f.type) is Literal and value not in get_args(f.type):
                raise ConfigValueError(f"{f.name} must be one of {get_args(f.type)}, got {value!r}")
            if "parse" in f.metadata:
                try:
                    setattr(self, f.name, f.metadata["parse"](value))
                except ValueError as exc:
                    exc.add_note(f"DMIConfig.{f.name}")
                    raise
        if self.end_iter is not None and self.end_iter < self.start_iter:
            raise CaptureWindowError(f"{self.end_iter} is before --dmi-start-iter {self.start_iter}")
        if self.spool_max_gb is not None and self.persist != "clickhouse":
            raise SpoolBoundError(
                f"bounds the spool that a store takes away, and --dmi-persist {self.persist} has none "
                "(a spool-only run keeps every segment by design)"
            )

    @property
    def enabled(self) -> bool:
        """Whether any output is selected for capture (DMI is on)."""
        return bool(self.hooks)

    @property
    def spool_max_bytes(self) -> int | None:
        """The spool bound in bytes (``spool_max_gb`` GiB), or None."""
        return None if self.spool_max_gb is None else max(1, int(self.spool_max_gb * (1 << 30)))

    @property
    def ring_bytes(self) -> int:
        """The ring's size in bytes (``ring_mb`` MiB)."""
        return int(self.ring_mb * (1 << 20))

    def captures_iteration(self, phase: str, iteration: int) -> bool:
        """Iterations are 1-based, as in Megatron's training log."""
        if phase not in self.phases:
            return False
        if iteration < self.start_iter or (self.end_iter is not None and iteration > self.end_iter):
            return False
        return (iteration - self.start_iter) % self.interval == 0

    def captures_layer(self, layer: int) -> bool:
        """Whether ``layer`` is captured (every layer is when ``layers`` is None)."""
        return self.layers is None or layer in self.layers
