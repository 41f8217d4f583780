"""Replay stored routing through megatron-core's ``RouterReplay`` (REPLAY_FORWARD, REPLAY_BACKWARD).

Each of this rank's ``TopKRouter``s gets a ``RouterReplay`` (what ``moe_enable_routing_replay``
would have built); before every training forward the session hands each one the stored top-k of
that (iteration, microbatch, layer). The router still computes its scores from the live weights and
gathers them at the replayed experts, so gradients reach it; capacity dropping, when configured, is
then decided afresh from the replayed choice.

Recompute: ``set_target_indices`` also queues the ids for the backward pass. A forward that runs
without grad (inside an activation checkpoint) leaves them queued, and its recompute, which runs
inside autograd's backward, takes them (REPLAY_BACKWARD: a FIFO per router, the order in which a
schedule runs one chunk's backwards); a forward with grad will not be recomputed, so its entry is
taken off the queue at once. Each queued selection is thus replayed exactly once more, or never.
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

from megatron.core.dmi.capture import inside_backward
from megatron.core.dmi.replay.extract import PROGRAM
from megatron.core.dmi.replay.request import (
    ReplayMissingError,
    ReplayRequest,
    ReplaySourceError,
    index_path,
)
from megatron.core.dmi.store_address import parse_store_run

MissingPolicy = Literal["error", "live"]


def routers_of(chunks: Iterable[torch.nn.Module]) -> dict[int, tuple[int, TopKRouter]]:
    """Global 0-based layer -> (its chunk's index, its TopKRouter), over every MoE layer of ``chunks``."""
    out = {}
    for vpp, chunk in enumerate(chunks):
        for module in chunk.modules():
            router = getattr(getattr(module, "mlp", None), "router", None)
            if isinstance(module, TransformerLayer) and isinstance(router, TopKRouter):
                out[module.layer_number - 1] = (vpp, router)
    return out


class RoutingReplay:
    """This rank's replay: the extracted selection (memory-mapped) and one RouterReplay per router."""

    def __init__(
        self, source: str, on_missing: MissingPolicy, routers: dict[int, tuple[int, TopKRouter]], request: ReplayRequest
    ):
        """Extract this rank's routing of ``source`` (``STORE[@RUN]``) in a subprocess and attach replay
        to ``routers``. Raises ReplaySourceError naming what differs between the stored run and this one."""
        self.on_missing = on_missing
        self.layers = sorted(routers)
        self.replayed = 0  # microbatches replayed
        self.fallbacks = 0  # microbatches routed live because the stored run lacked their iteration
        self._workdir = tempfile.TemporaryDirectory(prefix="dmi-replay-")
        out = os.path.join(self._workdir.name, "routing.npy")
        proc = subprocess.run(
            [sys.executable, "-c", PROGRAM, out],
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
        self.recomputed = 0  # router forwards replayed inside a backward pass (REPLAY_BACKWARD)
        self._replays = []  # (chunk index, RouterReplay) in the order of self.layers
        self._wrapped = []
        for layer in self.layers:
            vpp, router = routers[layer]
            if router.router_replay is None:
                router.router_replay = RouterReplay()
            self._replays.append((vpp, router.router_replay))
            self._wrap_routing(router)

    def _wrap_routing(self, router: TopKRouter) -> None:
        original = router.routing
        replay = router.router_replay

        def routing(*args, **kwargs):
            action = replay.router_replay_action
            if action is None:
                return original(*args, **kwargs)
            if inside_backward():  # a recompute: its original forward queued the ids
                replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
                try:
                    out = original(*args, **kwargs)
                finally:
                    replay.set_router_replay_action(action)
                self.recomputed += 1
                return out
            out = original(*args, **kwargs)
            if torch.is_grad_enabled():  # not inside a checkpoint: no recompute will take the queued ids
                replay.replay_backward_list.pop()
            return out

        self._wrapped.append((router, "routing" in vars(router), vars(router).get("routing")))
        router.routing = routing

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
        store, run = parse_store_run(source)
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

    def before_forward(self, phase: str, iteration: int, microbatch: int, vpp: int = 0) -> None:
        """Hand the routers of chunk ``vpp`` the stored selection of (``iteration``, ``microbatch``);
        evaluation forwards and, under the ``live`` policy, iterations the stored run lacks are routed live."""
        row = self._row.get(iteration) if phase == "train" else None
        if row is None:
            if phase == "train":
                self._missing(iteration)
            self.stop()
            return
        for j, (chunk, replay) in enumerate(self._replays):
            if chunk != vpp:
                continue
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
        """Route live from now on (until the next ``before_forward`` with stored routing); the ids
        queued for pending recomputes stay."""
        for _, replay in self._replays:
            replay.clear_router_replay_action()

    @property
    def status(self) -> str:
        """The replay's part of DMI's log line and report."""
        return (
            f"routing replayed from run {self.run_id}: {self.replayed} microbatches, "
            f"{self.recomputed} recomputed router forwards, fallbacks to live: {self.fallbacks}"
        )

    def close(self) -> None:
        """Route live, restore the routers' ``routing`` and delete the extracted file."""
        self.stop()
        for _, replay in self._replays:
            replay.clear_indices()
        for router, had_own, own in reversed(self._wrapped):
            if had_own:
                router.routing = own
            else:
                del router.routing
        self._data = None
        self._workdir.cleanup()
