"""NativeRingTransport: the C++/CUDA ring of ``csrc/dmi`` behind the Transport contract.

CPU tensors use the host build (C++ producer on the calling thread); CUDA tensors use the CUDA
build (producer kernels on the current stream, device gate and context block, a C++ drain thread
copying to pinned staging with the copy engine). Both implement one protocol (ring_protocol.h).

Keys travel in the descriptors: a static *site id* (``register_site``: run, layer, output, coords,
shard, token range, dtype, shape) plus the dynamic context words (iteration, microbatch, attempt,
phase, invocation) that the producer reads from the context block when it reserves the slot.
``take`` rebuilds every ``RecordKey`` from the descriptor alone.

Two ways to publish:

* ``publish(key, tensor)`` (the Transport contract): registers the key's site and hands the key's
  dynamic fields to the producer with the call, which writes them into the descriptor atomically
  with the reservation (safe with several publishing threads; the context block is not touched).
* ``publish_site(site_id, tensor)`` (also what the ``dmi::ring_capture`` custom op calls): no host
  state involved, so it can be captured in a CUDA graph; the host sets the gate and context before
  each replay (``set_gate``, ``set_context``).

CUDA publishes are asynchronous: ``publish`` returns True once the producer is enqueued; drops on
the device are counted in ``stats.dropped`` (read them after synchronising the stream).

Importing this module needs torch, numpy and pyarrow only (not megatron-core).
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pyarrow as pa
import torch

from megatron.core.dmi.key import PHASES, Firing, RecordKey
from megatron.core.dmi.records import Record, descriptor_table, dtype_name
from megatron.core.dmi.transport import jit
from megatron.core.dmi.transport.abi import ACCEPTED, FIRING_WORDS, MAX_GROUP, SLOT_ALIGN, TAKE_COLUMNS, on_full_code
from megatron.core.dmi.transport.base import (
    OnFull,
    Transport,
    TransportInputError,
    TransportStateError,
    TransportStats,
    capturing_graph,
)
from megatron.core.dmi.transport.blobs import BlobPool
from megatron.core.dmi.transport.native_api import CudaRing, HostRing

# A batch filling less than this share of its pooled buffer is copied out, so a trickle of small
# batches never pins many large buffers while they wait in the sink.
_MIN_FILL = 0.25


def _phase_code(phase: str | int) -> int:
    if isinstance(phase, int):
        if not 0 <= phase < len(PHASES):
            raise TransportInputError(f"phase code {phase} out of range for {PHASES}")
        return phase
    try:
        return PHASES.index(phase)
    except ValueError:
        raise TransportInputError(f"unknown phase {phase!r} (expected one of {PHASES})") from None


@functools.lru_cache(maxsize=1024)
def _context_words(firing: Firing) -> tuple[int, ...]:
    """A firing as the ``FIRING_WORDS`` context words a producer writes into its descriptor; cached,
    since every output of a step's firings shares a handful of firings."""
    iteration, microbatch, attempt, phase, invocation = firing
    return (iteration, microbatch, attempt, _phase_code(phase), invocation)


def site_json(key: RecordKey) -> str:
    """A site's static key as the native spool writer stores it (``RecordKey.from_flat`` reads it)."""
    return json.dumps(key.flat(), separators=(",", ":"))


class NativeRingTransport(Transport):
    """Native ring transport (host build for CPU tensors, CUDA build for CUDA tensors)."""

    name = "native"
    TAKE_BUFFER_BYTES = 128 << 20  # one take_table batch at most (larger records get their own buffer)
    MAX_GROUP = MAX_GROUP  # records per publish_group call

    def __init__(
        self,
        ring_bytes: int,
        on_full: OnFull,
        device: torch.device | str,
        *,
        block_timeout: float,
        desc_capacity: int | None = None,
        staging_bytes: int | None = None,
    ):
        """Build the native ring on ``device``: ``ring_bytes`` rounded down to whole slots, ``desc_capacity``
        descriptors and ``staging_bytes`` of staging (both sized from the ring by default)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(ring_bytes, on_full, device, block_timeout=block_timeout)
        cap = ring_bytes // SLOT_ALIGN * SLOT_ALIGN
        self.ring_bytes = cap
        if desc_capacity is None:
            desc_capacity = max(64, min(1 << 16, cap // SLOT_ALIGN + 64))
        if staging_bytes is None:
            staging_bytes = cap
        staging_bytes = -(-staging_bytes // SLOT_ALIGN) * SLOT_ALIGN
        if staging_bytes < cap:
            raise TransportInputError(f"staging_bytes ({staging_bytes}) must be >= the ring ({cap} bytes)")
        self.desc_capacity = int(desc_capacity)
        self.staging_bytes = int(staging_bytes)
        on_full_native = on_full_code(on_full)
        self._ring: HostRing | CudaRing
        if device.type == "cuda":
            self._mod = jit.load_cuda()
            self._ring = self._mod.CudaRing(
                device.index, cap, self.desc_capacity, self.staging_bytes, on_full_native, block_timeout
            )
        elif device.type == "cpu":
            self._mod = jit.load_host()
            self._ring = self._mod.HostRing(cap, self.desc_capacity, self.staging_bytes, on_full_native, block_timeout)
        else:
            raise TransportInputError(f"the native ring supports cpu and cuda tensors, not {device}")
        self._on_cuda = device.type == "cuda"
        # The payload ring as a uint8 tensor (DLPack view of the ring's own memory): the mutated
        # argument of the dmi::ring_capture custom op.
        self.ring_tensor = torch.utils.dlpack.from_dlpack(self._ring.payload_dlpack())
        self._sites: list[RecordKey] = []
        self._site_ids: dict[RecordKey, int] = {}
        self.blobs = BlobPool(min(self.staging_bytes, self.TAKE_BUFFER_BYTES))
        self._spool = None  # the native spool writer, when it is the consumer (start_spool)
        self._ctx = (0,) * FIRING_WORDS  # host copy of the context block (iteration, mb, attempt, phase, inv)
        self._closed = False
        self._last_stats = TransportStats()
        from megatron.core.dmi.transport import ops  # registers the custom op

        self.handle = ops.register_transport(self)

    # ------------------------------------------------------------------ stats
    @property
    def stats(self) -> TransportStats:  # type: ignore[override]
        """The ring's counters, read afresh at every access."""
        return self.refresh_stats()

    @stats.setter
    def stats(self, value: TransportStats) -> None:
        self._last_stats = value

    def refresh_stats(self) -> TransportStats:
        """Counters from the ring (device-side counters are mirrored into host memory by the
        producers: read them after synchronising the producing stream for exact values)."""
        if getattr(self, "_ring", None) is None or self._closed:
            return self._last_stats
        s = self._ring.stats()
        self._last_stats = TransportStats(
            published=s["published"],
            published_bytes=s["published_bytes"],
            dropped=s["dropped"],
            dropped_bytes=s["dropped_bytes"],
            rejected=s["rejected"],
            drained=s["taken"],
            drained_bytes=s["taken_bytes"],
            blocked=s["blocked"],
            blocked_seconds=s["blocked_ns"] / 1e9,
        )
        return self._last_stats

    # ------------------------------------------------------------------ sites, gate, context
    def register_site(self, key_template: RecordKey) -> int:
        """Static part of a key (everything but iteration/microbatch/attempt/phase/invocation) ->
        site id carried by the descriptors. Idempotent."""
        static = key_template.site()
        site = self._site_ids.get(static)
        if site is None:
            site = len(self._sites)
            if site >= 1 << 32:
                raise TransportStateError("too many DMI sites (2**32)")
            self._sites.append(static)
            self._site_ids[static] = site
            if self._spool is not None:
                self._spool.add_site(site, site_json(static))
        return site

    def set_gate(self, enabled: bool) -> None:
        """Open (True) or close (False) the device gate. On CUDA it is set on the current stream, so
        it applies to the producers enqueued after it (e.g. before a graph replay)."""
        self.set_gate_word(1 if enabled else 0)

    def set_gate_word(self, value: int) -> None:
        """Raw gate word: a producer launched with ``mask`` accepts when ``value & mask`` != 0."""
        if self.device.type == "cuda":
            self._check_not_capturing("set_gate")
            self._ring.set_gate(int(value), self._stream())
        else:
            self._ring.set_gate(int(value))

    def gate(self) -> int:
        """Current gate word (synchronous read; not for the hot path)."""
        return int(self._ring.gate())

    def set_context(
        self,
        *,
        iteration: int | None = None,
        microbatch: int | None = None,
        attempt: int | None = None,
        phase: str | int | None = None,
        invocation: int | None = None,
    ) -> None:
        """Update the context block read by every following producer (fields left None keep their
        value). On CUDA: a cudaMemcpyAsync on the current stream, before a step or graph replay."""
        it, mb, at, ph, inv = self._ctx
        ctx = (
            it if iteration is None else int(iteration),
            mb if microbatch is None else int(microbatch),
            at if attempt is None else int(attempt),
            ph if phase is None else _phase_code(phase),
            inv if invocation is None else int(invocation),
        )
        if self.device.type == "cuda":
            self._check_not_capturing("set_context")
            self._ring.set_context(list(ctx), self._stream())
        else:
            self._ring.set_context(list(ctx))
        self._ctx = ctx

    def context(self) -> dict:
        """The context block's current words, by ``Firing`` field name."""
        words = self._ring.context()
        return {name: int(words[i]) for i, name in enumerate(Firing._fields)}

    def _check_not_capturing(self, what: str) -> None:
        if capturing_graph():
            raise TransportStateError(
                f"NativeRingTransport.{what} cannot run inside CUDA graph capture: set the gate and "
                "context before each replay, outside the captured region"
            )

    # ------------------------------------------------------------------ publish
    def _stream(self) -> int:
        """The current CUDA stream's handle, read without building a ``torch.cuda.Stream`` (which
        costs microseconds per call on a path that runs for every firing)."""
        return torch._C._cuda_getCurrentRawStream(self.device.index)

    def _check_tensor(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != self.device.type or (
            self.device.type == "cuda" and tensor.device.index != self.device.index
        ):
            raise TransportInputError(f"tensor on {tensor.device} published to a native ring on {self.device}")

    def publish(self, key: RecordKey, tensor: torch.Tensor) -> bool:
        """Publish ``tensor`` under ``key``, registering its site first; the key's dtype and shape must be the
        tensor's."""
        self._check_tensor(tensor)
        if dtype_name(tensor.dtype) != key.dtype or tuple(tensor.shape) != tuple(key.shape):
            raise TransportInputError(
                f"tensor {tuple(tensor.shape)} {tensor.dtype} does not match key {key.shape} {key.dtype} ({key.output})"
            )
        self.check_fits(tensor.numel() * tensor.element_size())
        return self.publish_site(self.register_site(key), tensor, ctx=_context_words(key.firing))

    def site_handle(self, site: RecordKey) -> int:
        """The registered site id of ``site``."""
        return self.register_site(site)

    def publish_firing(self, handle: int, tensor: torch.Tensor, firing: Firing) -> bool:
        """The firing's words go with the call (see ``publish_site``'s ``ctx``)."""
        self._check_tensor(tensor)
        return self.publish_site(handle, tensor, ctx=_context_words(firing))

    def publish_firings(
        self, handles: list[int], tensors: list[torch.Tensor], firings: Firing | list[Firing]
    ) -> list[bool]:
        """The outputs of one hook firing in one native call per ``MAX_GROUP`` records, which reserves
        and copies them all (on a GPU: one pair of launches). ``firings``: one per record, or one
        ``Firing`` that every record shares. On a GPU every record reads True (the device decides; see
        ``stats``); on the host, whether it was accepted."""
        if self._closed:
            raise TransportStateError("transport is closed")
        n = len(tensors)
        shared = isinstance(firings, Firing)
        if n > self.MAX_GROUP:
            return [
                ok
                for start in range(0, n, self.MAX_GROUP)
                for ok in self.publish_firings(
                    handles[start : start + self.MAX_GROUP],
                    tensors[start : start + self.MAX_GROUP],
                    firings if shared else firings[start : start + self.MAX_GROUP],
                )
            ]
        ptrs, sizes, copies = self._sources(tensors)
        words = _context_words(firings) * n if shared else [w for f in firings for w in _context_words(f)]
        if self._on_cuda:
            self._ring.publish_group(ptrs, sizes, handles, 1, words, self._stream())
            return [True] * n
        return [code == ACCEPTED for code in self._ring.publish_group(ptrs, sizes, handles, 1, words)]

    def _sources(self, tensors) -> tuple[list[int], list[int], list[torch.Tensor]]:
        """(addresses, byte counts, copies made) of the bytes a producer copies for ``tensors``, each
        checked against the ring. A tensor that is not contiguous is copied, outside autograd (hooks
        publish with grad enabled); the caller keeps the copies until its native call returns, or a
        freed copy could be reused, and overwritten, by the next one before the producer reads it."""
        ptrs, sizes, copies = [], [], []
        for tensor in tensors:
            if tensor.device != self.device:
                self._check_tensor(tensor)
            if not tensor.is_contiguous():
                tensor = tensor.detach().contiguous()
                copies.append(tensor)
            nbytes = tensor.nbytes
            if nbytes > self.ring_bytes:
                self.check_fits(nbytes)
            ptrs.append(tensor.data_ptr() if nbytes else 0)
            sizes.append(nbytes)
        return ptrs, sizes, copies

    def publish_site(
        self, site_id: int, tensor: torch.Tensor, mask: int = 1, ctx: tuple[int, ...] | None = None
    ) -> bool:
        """Publish ``tensor`` under a registered site. The descriptor's context words come from the
        context block (``set_context``), or from ``ctx`` (``FIRING_WORDS`` words: iteration,
        microbatch, attempt, phase code, invocation) given with the call, which the producer writes
        into the descriptor atomically with the reservation (used by ``publish(key, tensor)``).
        Graph-capturable on CUDA (with ``ctx`` the words are baked into the graph). Returns False
        when the host build rejected (gate) or dropped it; CUDA always returns True (the device
        decides; see stats)."""
        if self._closed:
            raise TransportStateError("transport is closed")
        (ptr,), (nbytes,), copies = self._sources((tensor,))
        if self._on_cuda:
            self._ring.publish(ptr, nbytes, site_id, mask, self._stream(), ctx)
            return True
        return self._ring.publish(ptr, nbytes, site_id, mask, ctx) == ACCEPTED

    # ------------------------------------------------------------------ native spool
    def start_spool(
        self,
        directory: str,
        header: dict,
        first_seq: int,
        segment_bytes: int,
        linger_bytes: int,
        poll_seconds: float = 0.05,
        segment_seconds: float = 2.0,
    ) -> None:
        """Make a C++ thread the ring's consumer: it writes finished records straight from staging
        into raw spool segments (``<seq>.dmiraw`` in ``directory``, numbered from ``first_seq``;
        format in csrc/dmi/spool_writer.h), checksummed, without Python or the GIL; a segment closes
        at ``segment_bytes``, ``segment_seconds`` after its first record, or a flush. ``take*`` must
        not be used while it runs."""
        if self._spool is not None:
            raise TransportStateError("the native spool writer is already running")
        self._spool = self._mod.SpoolThread(
            self._ring,
            directory,
            json.dumps(header),
            int(first_seq),
            int(segment_bytes),
            int(linger_bytes),
            float(poll_seconds),
            float(segment_seconds),
        )
        for site, key in enumerate(self._sites):
            self._spool.add_site(site, site_json(key))

    @property
    def spooling(self) -> bool:
        """Whether the native spool writer is consuming the ring."""
        return self._spool is not None

    def spool_flush(self, timeout: float) -> bool:
        """Wait until every record published so far (synchronise the producing stream first) is
        in a closed, fsync'd segment."""
        return bool(self._spool.flush(float(timeout)))

    def spool_hold(self, held: bool) -> None:
        """Hold the native spool writer (it takes nothing from the ring, which fills and applies
        ``on_full``) or release it. A flush or stop still writes everything published before it."""
        self._spool.set_hold(bool(held))

    def spool_stats(self) -> dict | None:
        """The writer's live counters (None when it is not running); cheap, any thread."""
        spool = self._spool
        return None if spool is None else dict(spool.stats())

    def spool_progress(self) -> tuple[dict, list[tuple[str, int]]]:
        """The writer's counters, and the segments it closed since the last call (path, rows)."""
        return dict(self._spool.stats()), list(self._spool.take_closed())

    def stop_spool(self) -> tuple[dict, list[tuple[str, int]]]:
        """Write everything published so far (synchronise the producing stream first), close the
        last segment, end the writer; returns its final counters and the segments closed since the
        last ``spool_progress``."""
        self._spool.stop()
        out = self.spool_progress()
        self._spool = None
        return out

    # ------------------------------------------------------------------ take
    def take_with_seq(self, max_records: int, timeout: float) -> list[tuple[int, Record]]:
        """Like ``take`` but also returns each record's sequence number."""
        self._check_no_spool()
        raw = self._ring.take(int(max_records), float(timeout))
        out = []
        sites = self._sites
        for seq, site, it, mb, att, ph, inv, _nbytes, payload in raw:
            key = sites[site].fired(Firing(it, mb, att, PHASES[ph], inv))
            out.append((seq, Record(key, payload)))
        return out

    def take(self, max_records: int, timeout: float) -> list[Record]:
        """``take_with_seq`` without the sequence numbers."""
        return [r for _, r in self.take_with_seq(max_records, timeout)]

    def take_table(self, max_records: int, timeout: float, min_bytes: int = 0) -> pa.Table | None:
        """Finished records as one table whose payload column views a pooled buffer that one
        GIL-free C++ call filled and checksummed. The rest is built with calls that keep the GIL
        (no Arrow compute): every time a background thread re-takes the GIL the training thread
        is made to yield it, so the consumer's cost to training grows with its GIL round trips,
        not with its bytes. ``min_bytes``: linger up to ``timeout`` until that much is ready."""
        self._check_no_spool()
        lease = self.blobs.lease()
        raw, too_big = self._ring.take_into(
            int(max_records), float(timeout), lease.address, lease.nbytes, int(min_bytes)
        )
        if too_big:  # the next record alone is larger than a pooled buffer
            lease = self.blobs.lease(too_big)
            raw, too_big = self._ring.take_into(1, 0.0, lease.address, lease.nbytes)
        rows = np.frombuffer(raw, dtype=np.uint64).reshape(-1, len(TAKE_COLUMNS))
        if not len(rows):
            return None
        total = int(rows[:, TAKE_COLUMNS.index("nbytes")].sum())
        data = lease.buffer(total)
        if total < _MIN_FILL * lease.nbytes:
            data = pa.py_buffer(bytes(data))  # small: copy out and give the buffer back now
        del lease
        # Sites are registered before their records exist, so every row's site is known here.
        return descriptor_table(self._sites, rows, data)

    def _check_no_spool(self) -> None:
        if self._spool is not None:
            raise TransportStateError("the native spool writer is the consumer of this ring: take() is not available")

    def pending(self) -> int:
        """Records published but not yet taken, from the ring's counters."""
        s = self._ring.stats()
        return int(s["published"] - s["taken"])

    def settle(self) -> None:
        """Producer kernels publish their descriptors when they run: wait for the current stream."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def sync_drain(self, timeout: float = 10.0) -> bool:
        """Wait until the drain thread has moved everything it can (published so far, and fitting
        in staging) to the ready queue. On CUDA, synchronises the current stream first."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return bool(self._ring.sync(float(timeout)))

    def close(self) -> None:
        """Close the ring; a running native spool writer first writes everything published and stops. Idempotent."""
        if self._closed:
            return
        self.refresh_stats()
        self._closed = True
        from megatron.core.dmi.transport import ops

        ops.unregister_transport(self.handle)
        if self._spool is not None:
            self.settle()
            self.stop_spool()
        self._ring.close()  # memory is freed once the ring tensor is gone too

    def __del__(self):  # pragma: no cover - garbage collection
        """Close the ring if it was built (an error here is reported by Python, not hidden)."""
        if getattr(self, "_ring", None) is not None:
            self.close()
