"""What every hook group shares: this rank's coordinates, where its records sit (derived from the
catalog's ``producers``), a hook site's publishing state (``HookSite``), and the model facts a
group's refusal check reads.

A group module (``hooks/groups/<group>.py``, one per ``catalog.GROUPS`` entry) defines ``GROUP``,
its site functions (``layer_site``, ``block_site``, ``model_site``: each optional, called by
``HookSet.attach`` on every ``TransformerLayer``, ``TransformerBlock`` and language model of a
chunk) and, where a configuration cannot be captured exactly, ``refusal``, which both the
start-up checks of the flags and ``HookSet.attach`` call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from megatron.core import parallel_state as ps
from megatron.core.dmi import catalog
from megatron.core.dmi.capture import Capture, Placement, SiteRecord
from megatron.core.dmi.errors import DMIError
from megatron.core.dmi.key import ParallelCoords


class SiteInstaller(Protocol):
    """What a group's site functions use of the hook set installing them (``install.HookSet`` is the one):
    a protocol here, so the group modules depend on no module above them."""

    capture: Capture

    def hold(self, handle) -> None:
        """Keep a hook's removable handle until the hook set is removed."""

    def placed(self, layer: int, group: str) -> None:
        """Note that ``group`` has a site on global ``layer``."""

    def wrap(self, obj: object, name: str, wrapper: Callable) -> None:
        """Replace ``obj.name`` by ``wrapper`` until the hook set is removed."""


# (the flag to change, why the selected outputs cannot be captured with it)
Refusal = tuple[str, str]


class UnsupportedModelError(DMIError, ValueError):
    """The model's configuration cannot be captured exactly for a selected output (the flag to change is named)."""


@dataclass(frozen=True)
class ModelFacts:
    """What the groups' refusal checks read: the same facts from Megatron's arguments (start-up) or from
    a model's TransformerConfig (``HookSet.attach``)."""

    moe: bool = False
    mtp_layers: int = 0
    dispatcher: str = "allgather"
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    capacity_factor: float | None = None
    latent_size: int | None = None
    padding_for_quantization: bool = False
    shared_expert_overlap: bool = False

    @classmethod
    def of(cls, settings) -> ModelFacts:
        """The facts of a megatron-core TransformerConfig or of Megatron's parsed arguments: the same
        names but the expert count (``num_moe_experts`` in the config, ``num_experts`` in the arguments)."""
        experts = getattr(settings, "num_moe_experts", None) or getattr(settings, "num_experts", None)
        return cls(
            moe=bool(experts),
            mtp_layers=getattr(settings, "mtp_num_layers", None) or 0,
            dispatcher=settings.moe_token_dispatcher_type,
            tensor_parallel=settings.tensor_model_parallel_size,
            sequence_parallel=bool(settings.sequence_parallel),
            capacity_factor=settings.moe_expert_capacity_factor,
            latent_size=getattr(settings, "moe_latent_size", None),
            padding_for_quantization=bool(getattr(settings, "moe_router_padding_for_quantization", False)),
            shared_expert_overlap=bool(getattr(settings, "moe_shared_expert_overlap", False)),
        )


def rank_coords(vpp: int = 0) -> ParallelCoords:
    """This process's coordinates in every parallel group (0 where a group is not initialised)."""

    def safe(fn: Callable[[], int]) -> int:
        try:
            return int(fn() or 0)  # an uninitialised group answers None or raises
        except (AssertionError, AttributeError, RuntimeError):
            return 0

    return ParallelCoords(
        rank=torch.distributed.get_rank() if torch.distributed.is_initialized() else 0,
        tp=safe(ps.get_tensor_model_parallel_rank),
        pp=safe(ps.get_pipeline_model_parallel_rank),
        vpp=vpp,
        dp=safe(ps.get_data_parallel_rank),
        cp=safe(ps.get_context_parallel_rank),
        ep=safe(ps.get_expert_model_parallel_rank),
        etp=safe(ps.get_expert_tensor_parallel_rank),
    )


def tp_size() -> int:
    """The tensor-parallel world size (1 where the group is not initialised)."""
    try:
        return ps.get_tensor_model_parallel_world_size()
    except (AssertionError, AttributeError, RuntimeError):
        return 1


@dataclass(frozen=True)
class Shards:
    """Where this rank's records sit in the full tensors, for each output by its catalog ``producers``
    (see catalog.Producers): the one place a site's ``Placement`` comes from."""

    coords: ParallelCoords
    tp: int
    sequence_parallel: bool
    # "every" producers: the global ranks whose records make up one full tensor, in order
    group_ranks: tuple[int, ...] = ()

    @classmethod
    def of(cls, config, coords: ParallelCoords, group_ranks: tuple[int, ...] = ()) -> Shards:
        """This rank's shards, from ``config``'s sequence parallelism and the tensor-parallel group."""
        tp = tp_size()
        return cls(coords, tp, bool(config.sequence_parallel) and tp > 1, group_ranks)

    def placement(self, output: str, rows: int) -> Placement | None:
        """Where this rank's ``rows`` rows of ``output`` sit, or None when another rank publishes them."""
        producers = catalog.BY_NAME[output].producers
        tp_rank = self.coords.tp
        if producers == "tensor":
            return Placement(0, rows, rows, shard_index=tp_rank, shard_count=self.tp)
        if producers == "every":
            return Placement(0, rows, rows, self.group_ranks.index(self.coords.rank), len(self.group_ranks))
        if producers == "sequence" and self.sequence_parallel:
            start = tp_rank * rows
            return Placement(start, start + rows, rows * self.tp)
        if producers == "one" and self.coords.dp != 0:
            return None
        return Placement(0, rows, rows) if tp_rank == 0 else None


class HookSite:
    """What one hook site publishes, fixed when its hook is attached: its layer, the outputs it
    publishes on this rank (selected, on a captured layer, this rank among their producers) and,
    per record shape, each record's site key and transport handle. A firing then costs one lookup
    per record; nothing is built or hashed per output (an eager MoE step is host-bound).

    A hook returns at once when ``capture.idle`` (the step decided in ``Capture.begin_step``),
    publishes only when ``capture.recording()``, and hands ``publish`` one value per output it
    declared, in order (None for an output it does not publish: see ``publishes``)."""

    __slots__ = ("capture", "layer", "vpp", "shards", "outputs", "_records")

    def __init__(self, capture: Capture, layer: int, shards: Shards, declared: Sequence[str]):
        """The site at global ``layer`` whose hook hands the values of the ``declared`` outputs."""
        config = capture.config
        on_layer = config.captures_layer(layer)
        self.capture = capture
        self.layer = layer
        self.vpp = shards.coords.vpp
        self.shards = shards
        # (index among the declared values, output) of every output published here; whether this
        # rank produces an output does not depend on its row count
        self.outputs = tuple(
            (i, output)
            for i, output in enumerate(declared)
            if on_layer and output in config.hooks and shards.placement(output, 1) is not None
        )
        self._records: dict[tuple, SiteRecord] = {}  # (index, rows, dtype, shape) -> record

    def publishes(self, output: str) -> bool:
        """Whether this site publishes ``output`` (a hook computes only the values it publishes)."""
        return any(name == output for _, name in self.outputs)

    def publish(self, rows: int, values: Sequence[torch.Tensor | None]) -> int:
        """Publish one firing: ``values`` holds one tensor per declared output (``rows`` rows of the
        full tensor on this rank); returns how many records the transport accepted."""
        records = []
        tensors = []
        for i, output in self.outputs:
            tensor = values[i]
            kind = (i, rows, tensor.dtype, tensor.shape)
            record = self._records.get(kind)
            if record is None:
                where = self.shards.placement(output, rows)
                record = self._records[kind] = self.capture.site(output, self.layer, self.shards.coords, where, tensor)
            records.append(record)
            tensors.append(tensor)
        return self.capture.publish_records(self.layer, self.vpp, records, tensors)


def first(output) -> torch.Tensor:
    """A module's output tensor (the first item where the module returns a tuple)."""
    return output[0] if isinstance(output, tuple) else output
