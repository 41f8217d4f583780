"""Typed interfaces of the native modules (``csrc/dmi``), which are JIT-built under hashed names
and so cannot carry ``.pyi`` stubs: ``jit.load_host`` returns a ``HostModule``, ``jit.load_cuda`` a
``CudaModule``. Each signature mirrors one binding (``host_ring.cpp``, ``cuda_ring_bind.cpp``,
``bind_common.h``); ``tests/unit_tests/dmi/transport/test_abi.py`` checks that the host build
has every member named here. The module constants are those of ``abi.EXPECTED``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class SpoolThread(Protocol):
    """The native spool writer of a ring (``spool_writer.h``)."""

    def add_site(self, site: int, site_json: str) -> None:
        """Register a site's static key (JSON) before its records are written."""

    def flush(self, timeout: float) -> bool:
        """Wait until everything published so far is in a closed, fsync'd segment."""

    def stop(self) -> None:
        """Write everything published so far, close the last segment, end the thread."""

    def set_hold(self, hold: bool) -> None:
        """Held: take nothing from the ring unless a flush or stop waits (the spool bound)."""

    def take_closed(self) -> list[tuple[str, int]]:
        """Segments closed since the last call: (path, rows)."""

    def stats(self) -> dict[str, int]:
        """The writer's counters."""


class Ring(Protocol):
    """What both ring classes bind alike (``bind_ring_common``)."""

    def take(self, max_records: int, timeout: float) -> list[tuple]:
        """(seq, site, iteration, microbatch, attempt, phase, invocation, nbytes, payload) per record."""

    def take_into(
        self, max_records: int, timeout: float, dest: int, dest_cap: int, min_bytes: int = 0
    ) -> tuple[bytes, int]:
        """(take rows as uint64 words in ``TAKE_COLUMNS`` order, bytes the next record needs if too big)."""

    def sync(self, timeout: float) -> bool:
        """Wait until the drain moved everything it can to the ready queue."""

    def stats(self) -> dict[str, Any]:
        """The ring's counters."""

    def close(self) -> None:
        """Stop the drain; the memory goes with the last reference."""

    def payload_dlpack(self) -> Any:
        """A DLPack capsule viewing the payload ring as a uint8 tensor."""


class HostRing(Ring, Protocol):
    """The host build's ring (CPU tensors; the producer runs on the calling thread)."""

    def publish(self, src_ptr: int, nbytes: int, site: int, mask: int = 1, ctx: Sequence[int] | None = None) -> int:
        """One record; returns a ``PUBLISH_RESULT`` code."""

    def publish_group(
        self, src_ptrs: Sequence[int], nbytes: Sequence[int], sites: Sequence[int], mask: int, ctx: Sequence[int]
    ) -> list[int]:
        """1 to ``MAX_GROUP`` records (``FIRING_WORDS`` ctx words each, back to back); a code per record."""

    def set_gate(self, value: int) -> None:
        """Set the gate word."""

    def gate(self) -> int:
        """The gate word."""

    def set_context(self, words: Sequence[int]) -> None:
        """Set the context block (up to ``CTX_WORDS`` words)."""

    def context(self) -> list[int]:
        """The context block's ``CTX_WORDS`` words."""


class CudaRing(Ring, Protocol):
    """The CUDA build's ring (device payload ring, producer kernels on the given stream)."""

    def publish(
        self, src_ptr: int, nbytes: int, site: int, mask: int, stream: int, ctx: Sequence[int] | None = None
    ) -> None:
        """Enqueue one record's producer launches."""

    def publish_group(
        self,
        src_ptrs: Sequence[int],
        nbytes: Sequence[int],
        sites: Sequence[int],
        mask: int,
        ctx: Sequence[int],
        stream: int,
    ) -> None:
        """Enqueue 1 to ``MAX_GROUP`` records in one pair of launches."""

    def set_gate(self, value: int, stream: int) -> None:
        """Set the gate word on ``stream``."""

    def gate(self) -> int:
        """The gate word (synchronous)."""

    def set_context(self, words: Sequence[int], stream: int) -> None:
        """Set the context block on ``stream``."""

    def context(self) -> list[int]:
        """The context block (synchronous)."""


class RingModule(Protocol):
    """A native build's module: the constants of ``abi.EXPECTED`` and the spool writer."""

    SLOT_ALIGN: int
    CTX_WORDS: int
    FIRING_WORDS: int
    MAX_GROUP: int
    DESC_BYTES: int
    TAKE_WORDS: int
    TAKE_COLUMNS: tuple[str, ...]
    ON_FULL: dict[str, int]
    PUBLISH_RESULT: dict[str, int]
    ROUTER_DTYPE: dict[str, int]
    ROUTER_SELECT_MAX_K: int
    ROUTER_SELECT_MAX_EXPERTS: int
    BUILD: str

    def SpoolThread(  # noqa: N802 - the binding's class name
        self,
        ring: Ring,
        dir: str,
        header_json: str,
        first_seq: int,
        segment_bytes: int,
        linger_bytes: int,
        poll_s: float,
        segment_seconds: float,
    ) -> SpoolThread:
        """Start the native spool writer as ``ring``'s consumer."""


class HostModule(RingModule, Protocol):
    """The host build."""

    def HostRing(  # noqa: N802 - the binding's class name
        self, ring_bytes: int, desc_capacity: int, staging_bytes: int, on_full_block: int, block_timeout_s: float
    ) -> HostRing:
        """A ring in host memory (``on_full_block``: an ``ON_FULL`` code)."""


class CudaModule(RingModule, Protocol):
    """The CUDA build, with the router selection kernel."""

    def CudaRing(  # noqa: N802 - the binding's class name
        self,
        device: int,
        ring_bytes: int,
        desc_capacity: int,
        staging_bytes: int,
        on_full_block: int,
        block_timeout_s: float,
    ) -> CudaRing:
        """A ring on ``device`` (``on_full_block``: an ``ON_FULL`` code)."""

    def router_select(
        self,
        probs: int,
        routing_map: int,
        pre_probs: int,
        pre_map: int,
        tokens: int,
        experts: int,
        k: int,
        dtype: int,
        ids: int,
        weights: int,
        counts: int,
        stream: int,
    ) -> None:
        """Top-k ids, weights and expert counts in one launch (``dtype``: a ``ROUTER_DTYPE`` code)."""
