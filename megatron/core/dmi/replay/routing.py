"""Replay stored routing through megatron-core's ``RouterReplay`` (REPLAY_FORWARD).

Each of this rank's ``TopKRouter``s gets a ``RouterReplay`` (what ``moe_enable_routing_replay``
would have built); before every training forward the session hands each one the stored top-k of
that (iteration, microbatch, layer). The router still computes its scores from the live weights
and gathers them at the replayed experts, so gradients reach it; capacity dropping, when
configured, is then decided afresh from the replayed choice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from typing import Literal

import numpy as np
import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron.core.dmi.replay.request import (
    ReplayMissingError,
    ReplayRequest,
    ReplaySourceError,
    index_path,
    parse_source,
)

MissingPolicy = Literal["error", "live"]


def routers_of(chunks: Iterable[torch.nn.Module]) -> dict[int, TopKRouter]:
    """Global 0-based layer -> its TopKRouter, over every MoE layer of ``chunks``."""
    out = {}
    for chunk in chunks:
        for module in chunk.modules():
            router = getattr(getattr(module, "mlp", None), "router", None)
            if isinstance(module, TransformerLayer) and isinstance(router, TopKRouter):
                out[module.layer_number - 1] = router
    return out


class RoutingReplay:
    """This rank's replay: the extracted selection (memory-mapped) and one RouterReplay per router."""

    def __init__(self, source: str, on_missing: MissingPolicy, routers: dict[int, TopKRouter], request: ReplayRequest):
        """Extract this rank's routing of ``source`` (``STORE[@RUN]``) in a subprocess and attach replay
        to ``routers``. Raises ReplaySourceError naming what differs between the stored run and this one."""
        self.on_missing = on_missing
        self.layers = sorted(routers)
        self.replayed = 0  # microbatches replayed
        self.fallbacks = 0  # microbatches routed live because the stored run lacked their iteration
        self._workdir = tempfile.TemporaryDirectory(prefix="dmi-replay-")
        out = os.path.join(self._workdir.name, "routing.npy")
        proc = subprocess.run(
            [sys.executable, "-m", "megatron.core.dmi.replay.extract", out],
            input=request.to_json(),
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines() or [f"extraction failed with status {proc.returncode}"]
            raise ReplaySourceError(f"--dmi-replay-routing {source}: {lines[-1].removeprefix('error: ')}")
        with open(index_path(out), encoding="utf-8") as f:
            index = json.load(f)
        self.run_id = index["run"]
        self.unusable = {int(k): v for k, v in index["unusable"].items()}
        self._row = {it: i for i, it in enumerate(index["iterations"])}
        self._data = np.load(out, mmap_mode="r")
        self._replays = []
        for layer in self.layers:
            router = routers[layer]
            if router.router_replay is None:
                router.router_replay = RouterReplay()
            self._replays.append(router.router_replay)

    @classmethod
    def start(
        cls,
        source: str,
        on_missing: MissingPolicy,
        chunks: Sequence[torch.nn.Module],
        facts: dict[str, object],
        microbatches: int,
        coords,
        sizes: dict[str, int],
        sequence_parallel: bool,
    ) -> RoutingReplay:
        """Replay for the routers of ``chunks``: this rank's ``coords`` and group ``sizes`` (dp, tp) place
        its tokens; ``facts`` are this run's model facts the stored run must match."""
        store, run = parse_source(source)
        routers = routers_of(chunks)
        request = ReplayRequest(
            store=store,
            run=run,
            layers=sorted(routers),
            dp=coords.dp,
            dp_size=sizes["dp"],
            tp=coords.tp,
            tp_size=sizes["tp"],
            sequence_parallel=sequence_parallel and sizes["tp"] > 1,
            microbatches=microbatches,
            facts=facts,
        )
        return cls(source, on_missing, routers, request)

    def before_forward(self, phase: str, iteration: int, microbatch: int) -> None:
        """Hand every router the stored selection of (``iteration``, ``microbatch``); evaluation
        forwards and, under the ``live`` policy, iterations the stored run lacks are routed live."""
        row = self._row.get(iteration) if phase == "train" else None
        if row is None:
            if phase == "train":
                self._missing(iteration)
            self.stop()
            return
        for j, replay in enumerate(self._replays):
            replay.clear_indices()
            replay.set_target_indices(torch.from_numpy(np.array(self._data[row, microbatch, j])))
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        self.replayed += 1

    def _missing(self, iteration: int) -> None:
        why = self.unusable.get(iteration, "not captured")
        if self.on_missing == "error":
            raise ReplayMissingError(
                f"--dmi-replay-routing: stored run {self.run_id} has no usable routing for iteration {iteration} "
                f"({why}); use --dmi-replay-missing live to route such iterations live"
            )
        self.fallbacks += 1

    def stop(self) -> None:
        """Route live from now on (until the next ``before_forward`` with stored routing)."""
        for replay in self._replays:
            replay.clear_router_replay_action()
            replay.clear_indices()

    @property
    def status(self) -> str:
        """The replay's part of DMI's log line and report."""
        return f"routing replayed from run {self.run_id}: {self.replayed} microbatches, fallbacks to live: {self.fallbacks}"

    def close(self) -> None:
        """Route live and delete the extracted file."""
        self.stop()
        self._data = None
        self._workdir.cleanup()
