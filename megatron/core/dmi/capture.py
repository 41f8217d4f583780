"""Capture: turns a hook firing into a keyed record on the transport, or into nothing.

It owns the step context (phase, iteration, microbatch, attempt) that the training integration
sets from the running schedule, applies the selection (iteration, layer, output), and decides
what a firing inside activation recomputation means (a replay: rejected, or kept as invocation 1).
Gradients (backward outputs) are published from tensor hooks during backward, under the step
fields of the forward that made the tensor (``gradient_firing``, ``publish_gradient``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

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
        """Hash once: every firing looks its sites up by placement."""
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

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
        # Nothing to record in this step: every site returns on this one attribute (an eager MoE
        # step is host-bound, and uncaptured steps are most steps).
        self.idle = True
        self.transport = transport
        self.run_id = run_id
        self.attempt = attempt
        self.step = StepContext()
        self.stats = CaptureStats()
        # Originals awaiting their replay, per (layer, output, vpp): backward replays a chunk's
        # microbatches in the order their forwards ran, so a FIFO recovers the replay's microbatch.
        # A backward output queues there too when its original ran inside a checkpoint (see
        # gradient_firing).
        self._awaiting_replay: dict[tuple, collections.deque[int]] = collections.defaultdict(collections.deque)
        # (output, layer, coords, placement, dtype, shape) -> (site key, transport handle), made once
        self._sites: dict[tuple, tuple[RecordKey, object]] = {}
        # Called with (layer, step, outputs) for every eager original forward firing that publishes,
        # e.g. the training side's TensorBoard scalars; they must not sync with the device.
        self.observers: list[Callable[[int, StepContext, dict[str, torch.Tensor]], None]] = []

    def begin_step(self, phase: str, iteration: int, wanted: bool = True) -> None:
        """Enter a step: the microbatch restarts at 0, the config decides whether this iteration of ``phase`` is
        captured (never when not ``wanted``: a caller's per-step switch), and originals still awaiting their
        replay are forgotten."""
        self.step = StepContext(phase, iteration, 0, wanted and self.config.captures_iteration(phase, iteration))
        self.idle = not self.step.active and not self.graphs
        self._awaiting_replay.clear()

    def set_microbatch(self, microbatch: int) -> None:
        """Set the microbatch index of the current step."""
        self.step.microbatch = microbatch

    def wants(self, output: str, layer: int) -> bool:
        """Selected output and layer, in a captured step; while a CUDA graph is being captured the
        step does not matter: the graph's producer is gated on the device at every replay."""
        if self.idle:
            return False
        if output not in self.config.hooks or not self.config.captures_layer(layer) or in_graph_warmup():
            return False
        return self.step.active or capturing_graph()

    def publish_all(
        self, layer: int, coords: ParallelCoords, where: Placement, tensors: dict[str, torch.Tensor]
    ) -> int:
        """Publish the outputs of one hook firing (output -> tensor, all at one placement) in one
        transport call; returns how many were accepted."""
        if capturing_graph():
            return sum(self._publish_in_graph(o, layer, coords, t, where) for o, t in tensors.items())
        replaying = inside_backward()
        if replaying and not self.config.record_replays:
            self.stats.replays_rejected += len(tensors)
            return 0
        if replaying or self.config.record_replays:  # each output has its own replay queue
            firings = [self._firing(output, layer, coords, replaying) for output in tensors]
        else:  # every output of an original firing shares its step fields
            firings = [Firing(self.step.iteration, self.step.microbatch, self.attempt, self.step.phase, 0)] * len(
                tensors
            )
        sites = [self._site(output, layer, coords, tensor, where) for output, tensor in tensors.items()]
        accepted = self.transport.publish_firings([handle for _, handle in sites], list(tensors.values()), firings)
        if not replaying:
            for observe in self.observers:
                observe(layer, self.step, tensors)
        if not all(accepted):
            for (site, _), firing, ok in zip(sites, firings, accepted):
                if not ok:
                    self.stats.dropped_keys.append(site.fired(firing))
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
        site, handle = self._site(output, layer, coords, gradient, where)
        (accepted,) = self.transport.publish_firings([handle], [gradient], [firing])
        if not accepted:
            self.stats.dropped_keys.append(site.fired(firing))
        return accepted

    def _firing(self, output: str, layer: int, coords: ParallelCoords, replaying: bool) -> Firing:
        """This firing's step fields; a recorded replay takes its original's microbatch."""
        replay_queue = self._awaiting_replay[(layer, output, coords.vpp)]
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

    def _publish_in_graph(self, output, layer, coords, tensor, where) -> bool:
        """Enqueue a device-gated producer; iteration/microbatch come from the device context
        block that the runtime sets before each replay (see DMIRuntime.before_forward)."""
        _, site = self._site(output, layer, coords, tensor, where)
        mask = GATE_REPLAY if inside_backward() else GATE_ORIGINAL
        return self.transport.publish_site(site, tensor, mask=mask)

    def _site(self, output, layer, coords, tensor, where) -> tuple[RecordKey, object]:
        """A capture site's key and transport handle, made on its first firing: hooks fire every
        microbatch, and building and hashing a full key each time costs host time that an eager
        MoE step (host-bound) pays in step time."""
        cache_key = (output, layer, coords, where, tensor.dtype, tensor.shape)
        entry = self._sites.get(cache_key)
        if entry is None:
            site = self._site_key(output, layer, coords, tensor, where)
            entry = self._sites[cache_key] = (site, self.transport.site_handle(site))
        return entry

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
