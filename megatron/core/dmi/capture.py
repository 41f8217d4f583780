"""Capture: turns a hook firing into a keyed record on the transport, or into nothing.

It owns the step context (phase, iteration, microbatch, attempt) that the training integration
sets from the running schedule, applies the selection (iteration, layer, output), and decides
what a firing inside activation recomputation means (a replay: rejected, or kept as invocation 1).
Gradients (backward outputs) are published from tensor hooks during backward, under the step
fields of the forward that made the tensor (``gradient_firing``, ``publish_gradient``).
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from megatron.core.dmi.config import DMIConfig
from megatron.core.dmi.errors import DMIError
from megatron.core.dmi.key import SITE_FIRING, Firing, ParallelCoords, RecordKey
from megatron.core.dmi.records import dtype_name
from megatron.core.dmi.transport.base import Transport, capturing_graph

# Device gate bits (native transport): a producer captured into a CUDA graph publishes on replay
# only when the gate word has its bit. Original forwards carry GATE_ORIGINAL; producers captured
# inside backward (recompute replays) carry GATE_REPLAY, which the gate never opens.
GATE_ORIGINAL = 1
GATE_REPLAY = 2


@functools.cache
def _graph_state() -> tuple[Callable[[], bool], Callable[[], bool]] | None:
    """megatron-core's (is_graph_warmup, is_graph_capturing), imported once (checked on every firing)."""
    try:
        from megatron.core.transformer.cuda_graphs import is_graph_capturing, is_graph_warmup
    except ImportError:
        return None
    return is_graph_warmup, is_graph_capturing


def in_graph_warmup() -> bool:
    """megatron-core runs layers eagerly before capturing their CUDA graphs: its local
    implementation's warm-up steps, and TE's ``make_graphed_callables`` warm-up on sample inputs,
    which runs while megatron-core marks the graphs as being captured but no stream captures. Those
    runs are not training forwards and must not be recorded."""
    state = _graph_state()
    if state is None:
        return False
    is_graph_warmup, is_graph_capturing = state
    return is_graph_warmup() or (is_graph_capturing() and not capturing_graph())


def inside_backward() -> bool:
    """True while autograd runs a backward pass: the signature of a recompute replay (forward
    code) and of a gradient hook (backward code, see ``Capture.publish_gradient``).

    "Grad enabled" is no test: full recompute runs the original forward without grad.
    """
    return torch._C._current_graph_task_id() != -1


class ReplayWithoutOriginalError(DMIError, RuntimeError):
    """A recompute replay fired for an (output, layer) whose original forward was never recorded."""


@dataclass(frozen=True)
class Placement:
    """Where one rank's record sits in the full tensor (see RecordKey)."""

    token_start: int
    token_end: int
    token_total: int
    shard_index: int = 0
    shard_count: int = 1

    def __post_init__(self):
        """Hash once: sites are looked up by placement."""
        object.__setattr__(
            self,
            "_hash",
            hash((self.token_start, self.token_end, self.token_total, self.shard_index, self.shard_count)),
        )

    def __hash__(self):
        """The hash computed at construction."""
        return self._hash


@dataclass
class StepContext:
    """The schedule's position: phase, iteration and microbatch, and whether this step is captured."""

    phase: str = "train"
    iteration: int = 0
    microbatch: int = 0
    active: bool = False  # host gate: is this step captured at all


class SiteRecord(NamedTuple):
    """One record of a hook site, fixed for its shape: the output, its site key and its transport handle."""

    output: str
    key: RecordKey
    handle: object


@dataclass
class CaptureStats:
    """Recompute replays rejected or recorded, and the keys of the records the transport dropped."""

    replays_rejected: int = 0
    replays_recorded: int = 0
    dropped_keys: list[RecordKey] = field(default_factory=list)


class Capture:
    """Turns hook firings into records: applies the step context and the replay rule, then publishes."""

    def __init__(self, config: DMIConfig, transport: Transport, run_id: str, attempt: int, graphs: bool = False):
        """``graphs``: the model's forwards may be captured into CUDA graphs, whose producers are
        recorded whatever the step (they are gated on the device at every replay)."""
        self.config = config
        self.graphs = graphs
        # Nothing to record in this step, decided once per step (begin_step): every site returns on
        # this one attribute (an eager MoE step is host-bound, and uncaptured steps are most steps).
        self.idle = True
        self.transport = transport
        self.run_id = run_id
        self.attempt = attempt
        self.step = StepContext()
        # the step fields of this microbatch's original (not replayed) firings, shared by all of them
        self._original = Firing(0, 0, attempt, self.step.phase, 0)
        self.stats = CaptureStats()
        # Originals awaiting their replay, per (layer, output, vpp): backward replays a chunk's
        # microbatches in the order their forwards ran, so a FIFO recovers the replay's microbatch.
        # A backward output queues there too when its original ran inside a checkpoint (see
        # gradient_firing).
        self._awaiting_replay: dict[tuple, collections.deque[int]] = collections.defaultdict(collections.deque)
        # (output, layer, coords, placement, dtype, shape) -> its record's site key and handle, made once
        self._sites: dict[tuple, SiteRecord] = {}
        # Called with (layer, step, outputs) for every eager original forward firing that publishes,
        # e.g. the training side's TensorBoard scalars; they must not sync with the device.
        self.observers: list[Callable[[int, StepContext, dict[str, torch.Tensor]], None]] = []

    def begin_step(self, phase: str, iteration: int, wanted: bool = True) -> None:
        """Enter a step: the microbatch restarts at 0, the config decides whether this iteration of ``phase`` is
        captured (never when not ``wanted``: a caller's per-step switch), and originals still awaiting their
        replay are forgotten."""
        self.step = StepContext(phase, iteration, 0, wanted and self.config.captures_iteration(phase, iteration))
        self.idle = not self.step.active and not self.graphs
        self._original = Firing(iteration, 0, self.attempt, phase, 0)
        self._awaiting_replay.clear()

    def set_microbatch(self, microbatch: int) -> None:
        """Set the microbatch index of the current step."""
        self.step.microbatch = microbatch
        self._original = self._original._replace(microbatch=microbatch)

    def recording(self) -> bool:
        """Whether a firing now, in a step that is not ``idle``, is recorded: not in a CUDA-graph
        warm-up, and in a captured step or while a CUDA graph is being captured (the graph's producer
        is gated on the device at every replay, so the step does not matter)."""
        return not in_graph_warmup() and (self.step.active or capturing_graph())

    def wants(self, output: str, layer: int) -> bool:
        """Selected output and layer, and a firing now is recorded (``recording``)."""
        if self.idle or output not in self.config.hooks or not self.config.captures_layer(layer):
            return False
        return self.recording()

    def site(
        self, output: str, layer: int, coords: ParallelCoords, where: Placement, tensor: torch.Tensor
    ) -> SiteRecord:
        """The record of ``output`` at ``layer`` with ``tensor``'s dtype and shape, placed at ``where``:
        its site key and transport handle, made once per site (hooks fire every microbatch)."""
        cache_key = (output, layer, coords, where, tensor.dtype, tensor.shape)
        record = self._sites.get(cache_key)
        if record is None:
            key = self._site_key(output, layer, coords, tensor, where)
            record = self._sites[cache_key] = SiteRecord(output, key, self.transport.site_handle(key))
        return record

    def publish_records(self, layer: int, vpp: int, records: list[SiteRecord], tensors: list[torch.Tensor]) -> int:
        """Publish the records of one hook firing at ``layer`` of virtual pipeline stage ``vpp``
        (``records[i]`` with ``tensors[i]``) in one transport call; returns how many were accepted."""
        if capturing_graph():  # device-gated producers; the step fields come from the device context block
            mask = GATE_REPLAY if inside_backward() else GATE_ORIGINAL
            return sum(self.transport.publish_site(r.handle, t, mask=mask) for r, t in zip(records, tensors))
        replaying = inside_backward()
        if replaying and not self.config.record_replays:
            self.stats.replays_rejected += len(tensors)
            return 0
        if replaying or self.config.record_replays:  # each output has its own replay queue
            firings = [self._firing(r.output, layer, vpp, replaying) for r in records]
        else:  # every output of an original firing shares its step fields
            firings = self._original
        accepted = self.transport.publish_firings([r.handle for r in records], tensors, firings)
        if self.observers and not replaying:
            outputs = {r.output: t for r, t in zip(records, tensors)}
            for observe in self.observers:
                observe(layer, self.step, outputs)
        if not all(accepted):
            per_record = [firings] * len(records) if isinstance(firings, Firing) else firings
            self.stats.dropped_keys += [r.key.fired(f) for r, f, ok in zip(records, per_record, accepted) if not ok]
        return sum(accepted)

    def gradient_firing(self, output: str, layer: int, vpp: int, tensor: torch.Tensor) -> Firing | None:
        """The step fields under which the gradient of ``tensor`` (this forward firing's value of
        the backward output ``output``) is to be recorded, or None when no gradient hook belongs on
        this tensor. Call it for every selected firing in a training forward.

        Autograd differentiates the graph that made the tensor it uses. Without recompute that is the
        original forward's. Inside a checkpoint the original forward runs without grad and its
        replay, during backward, builds the graph that autograd differentiates: the original queues
        its microbatch, and the replay (a FIFO per chunk, as for recorded replays) takes it. So each
        gradient gets one hook, carrying the microbatch of its forward, not the schedule's current one.
        """
        queue = self._awaiting_replay[(layer, output, vpp)]
        if inside_backward():
            if not queue:  # its original ran with grad and holds the hook
                return None
            microbatch = queue.popleft()
        elif not torch.is_grad_enabled():
            queue.append(self.step.microbatch)
            return None
        else:
            microbatch = self.step.microbatch
        if not tensor.requires_grad:  # nothing upstream is trained: no gradient will come
            return None
        return Firing(self.step.iteration, microbatch, self.attempt, self.step.phase, 0)

    def publish_gradient(
        self, output: str, layer: int, coords: ParallelCoords, where: Placement, gradient: torch.Tensor, firing: Firing
    ) -> bool:
        """Publish a gradient from its tensor hook, with the step fields ``gradient_firing`` gave
        in the forward (the schedule may have run other microbatches' forwards since)."""
        record = self.site(output, layer, coords, where, gradient)
        (accepted,) = self.transport.publish_firings([record.handle], [gradient], firing)
        if not accepted:
            self.stats.dropped_keys.append(record.key.fired(firing))
        return accepted

    def _firing(self, output: str, layer: int, vpp: int, replaying: bool) -> Firing:
        """This firing's step fields; a recorded replay takes its original's microbatch."""
        replay_queue = self._awaiting_replay[(layer, output, vpp)]
        microbatch, invocation = self.step.microbatch, 0
        if replaying:
            if not replay_queue:
                raise ReplayWithoutOriginalError(
                    f"DMI: replay of {output} layer {layer} without a recorded original forward"
                )
            microbatch, invocation = replay_queue.popleft(), 1
            self.stats.replays_recorded += 1
        elif self.config.record_replays:
            replay_queue.append(microbatch)
        return Firing(self.step.iteration, microbatch, self.attempt, self.step.phase, invocation)

    def _site_key(self, output, layer, coords, tensor, where) -> RecordKey:
        return RecordKey(
            run_id=self.run_id,
            **SITE_FIRING._asdict(),
            layer=layer,
            output=output,
            coords=coords,
            shard_index=where.shard_index,
            shard_count=where.shard_count,
            token_start=where.token_start,
            token_end=where.token_end,
            token_total=where.token_total,
            dtype=dtype_name(tensor.dtype),
            shape=tuple(tensor.shape),
        )
