"""DMIRuntime: DMI's life inside one training process.

Created on the first forward step (model built, process groups up), it owns the transport, the
drain, the sink and the hooks; takes the step context from the schedule; flushes and saves its
state with every checkpoint; prints DMI's line at each log interval; and closes everything at the
end with an end-of-run report.
"""

from __future__ import annotations

import atexit
import json
import os
import time
import uuid
from importlib import metadata

import torch

import megatron.training.training as mt_training
from megatron.training import get_args, print_rank_0

from megatron.core.dmi import __version__ as dmi_version
from megatron.core.dmi.capture import GATE_ORIGINAL, Capture
from megatron.core.dmi.config import DMIConfig, check_run_id
from megatron.core.dmi.drain import Drain
from megatron.core.dmi.hooks.install import HookSet, rank_coords
from megatron.core.dmi.sinks import RunInfo, open_sink
from megatron.core.dmi.sinks.base import SinkReport
from megatron.core.dmi.transport import open_transport
from megatron.training.dmi.arguments import config_from_args, ring_memory_problem
from megatron.training.dmi.entry import compute_device

STATE_FILE = "dmi_state_iter_{:07d}.json"


def _dist() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _broadcast(obj):
    if not _dist() or torch.distributed.get_world_size() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


def _allocate_attempt(store_dir: str, run_id: str) -> int:
    """Attempts are numbered by exclusive creation of a marker file, so a crashed attempt that never
    saved a checkpoint still owns its number and its records stay distinguishable."""
    folder = os.path.join(store_dir, "attempts", check_run_id(run_id))  # also a run id read from a state file
    os.makedirs(folder, mode=0o700, exist_ok=True)
    attempt = 1
    while True:
        try:
            os.close(os.open(os.path.join(folder, str(attempt)), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return attempt
        except FileExistsError:
            attempt += 1


class DMIRuntime:
    _instance: "DMIRuntime | None" = None

    @classmethod
    def start(cls, model=None) -> "DMIRuntime":
        """Start DMI for the model chunks of this rank (a module or a list, one per virtual pipeline
        stage). Every rank must call it at the same point: it runs collectives."""
        if cls._instance is None:
            cls._instance = cls(config_from_args(get_args()))
        if model is not None:
            cls._instance.attach(model if isinstance(model, (list, tuple)) else [model])
        return cls._instance

    @classmethod
    def shutdown(cls) -> None:
        if cls._instance is not None:
            cls._instance.close()
            cls._instance = None

    def __init__(self, config: DMIConfig):
        args = get_args()
        self.config = config
        self.args = args
        resumed_from = args.iteration if (args.load and args.iteration) else None
        run_id, attempt = None, None
        if not _dist() or torch.distributed.get_rank() == 0:
            run_id = config.run_id or self._resumed_run_id(resumed_from) or f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
            attempt = _allocate_attempt(config.store_dir, run_id)
        self.run_id, self.attempt = _broadcast((run_id, attempt))
        self.resumed_from = resumed_from
        self.coords = rank_coords()
        why = ring_memory_problem(config.ring_mb)  # again now that CUDA is initialised: the device's free memory
        if why:
            raise SystemExit(f"error: argument --dmi-ring-mb: {why}")
        self.transport = open_transport(config, compute_device())
        self.sink = open_sink(config, self.coords, self.run_id, is_ingester=int(os.environ.get("LOCAL_RANK", "0")) == 0)
        self.capture = Capture(config, self.transport, self.run_id, self.attempt)
        self.hooks = HookSet(self.capture)
        self.drain = Drain(self.transport, self.sink, batch_records=config.flush_records)
        self._chunks: dict[int, int] = {}  # id(unwrapped chunk) -> virtual pipeline stage
        self._training_done = False
        self._step: tuple[str, int] | None = None
        self._microbatch: dict[int, int] = {}
        self._drops_written = 0
        # Under CUDA graphs the producers replay without Python: the device gate and context block
        # carry the step, set on the stream before every forward.
        self._device_context = getattr(args, "cuda_graph_impl", "none") != "none"
        if self._device_context and not hasattr(self.transport, "publish_site"):
            raise RuntimeError("DMI: CUDA graphs need the native transport, which could not be built here "
                               "(run `python -m megatron.core.dmi doctor --build`)")
        self._patch_training_loop()
        atexit.register(DMIRuntime.shutdown)
        print_rank_0(
            f"DMI: run {self.run_id} attempt {self.attempt} capturing {', '.join(sorted(config.hooks))} "
            f"via {self.transport.name} transport into {config.persist} ({config.clickhouse_url or config.store_dir})"
        )

    def _resumed_run_id(self, iteration: int) -> str | None:
        if not iteration:
            return None
        path = os.path.join(self.args.load, STATE_FILE.format(iteration))
        if not os.path.exists(path):
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)["run_id"]

    def _write_state(self, iteration: int) -> None:
        """``dmi_state_iter_N.json`` in --save, durable (fsync) before Megatron writes checkpoint N."""
        save_dir = self.args.save
        if not save_dir or (_dist() and torch.distributed.get_rank() != 0):
            return
        os.makedirs(save_dir, exist_ok=True)
        path = os.path.join(save_dir, STATE_FILE.format(iteration))
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"run_id": self.run_id, "attempt": self.attempt, "iteration": iteration}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)

    def _write_run_info(self) -> None:
        versions = {"torch": torch.__version__, "megatron-core": metadata.version("megatron-core"), "megatron-dmi": dmi_version}
        config = {k: (sorted(v) if isinstance(v, frozenset) else v) for k, v in vars(self.config).items() if k != "clickhouse_password"}
        self.sink.write_run(
            RunInfo(
                run_id=self.run_id,
                attempt=self.attempt,
                resumed_from_iteration=self.resumed_from,
                config=config,
                versions=versions,
                coords=self.coords,
                layers=sorted(self.hooks.layers),
                world_size=torch.distributed.get_world_size() if _dist() else 1,
            )
        )

    # -- the training loop ------------------------------------------------------------------
    def attach(self, chunks: list) -> None:
        """Hooks on every model chunk (index = virtual pipeline stage), then this rank's topology row."""
        new = False
        for vpp, chunk in enumerate(chunks):
            inner = _unwrap(chunk)
            if id(inner) not in self._chunks:
                self._chunks[id(inner)] = vpp
                self.hooks.attach(inner, vpp)
                new = True
        if new:
            self._write_run_info()

    def end_training(self) -> None:
        """The training loop returned: later forwards (pretrain's final evaluations) are not captured."""
        self._training_done = True
        self.capture.begin_step("done", -1)
        if self._device_context:
            self.transport.set_gate_word(0)

    def before_forward(self, model: torch.nn.Module) -> None:
        if self._training_done:
            return
        chunk = _unwrap(model)
        chunk_id = id(chunk)
        if chunk_id not in self._chunks:  # a chunk built outside the training loop's list
            self.attach([chunk])
        phase = "train" if model.training else "valid"
        # Megatron sets curr_iteration to the number of completed iterations before each step; the
        # evaluation after step N runs with it unchanged, so it belongs to iteration N too.
        step = (phase, self.args.curr_iteration + 1)
        if step != self._step:
            self._step = step
            self._microbatch.clear()
            self.capture.begin_step(*step)
            self._write_new_drops()
            if self._device_context:
                self.transport.set_gate_word(GATE_ORIGINAL if self.capture.step.active else 0)
        # Every schedule (1F1B, interleaved) runs one model chunk's forwards in microbatch order, so
        # counting calls per chunk gives the microbatch index; evaluation continues the count over
        # its eval-iters batches (batch b, microbatch m -> b * microbatches + m).
        microbatch = self._microbatch.get(chunk_id, 0)
        self._microbatch[chunk_id] = microbatch + 1
        self.capture.set_microbatch(microbatch)
        if self._device_context and self.capture.step.active:
            self.transport.set_context(iteration=step[1], microbatch=microbatch, attempt=self.attempt,
                                       phase=step[0], invocation=0)

    def _write_new_drops(self) -> None:
        keys = self.capture.stats.dropped_keys
        if len(keys) > self._drops_written:
            self.sink.write_drops(keys[self._drops_written :], reason="ring full (--dmi-on-full drop)")
            self._drops_written = len(keys)

    def flush(self) -> None:
        self._write_new_drops()
        self.drain.flush()

    def status_line(self) -> str:
        t = self.transport.stats
        lag = self.sink.store_lag()
        store = f"store lag: {lag} records" if lag is not None else f"store: none ({self.config.persist})"
        return (
            f" DMI | captured: {t.published} records {t.published_bytes / 2**20:.1f} MiB |"
            f" dropped: {t.dropped} | drain lag: {self.drain.lag_records} records |"
            f" persisted: {self.drain.records_persisted} records | {store} |"
            f" replays rejected: {self.capture.stats.replays_rejected} |"
            + (f" waited for ring space: {t.blocked_seconds:.2f} s ({t.blocked} records) |" if t.blocked else "")
        )

    def _patch_training_loop(self) -> None:
        """Checkpoint saves flush DMI and store its state; the log interval prints DMI's line."""
        save, log = mt_training.save_checkpoint, mt_training.training_log
        runtime = self

        def save_checkpoint(iteration, *args, **kwargs):
            runtime.flush()
            # The state file goes first: a checkpoint that exists (whatever the crash point) always
            # has its run identity beside it, so its resume continues this run. A state file whose
            # checkpoint never completed is harmless: nothing resumes from that iteration.
            runtime._write_state(iteration)
            return save(iteration, *args, **kwargs)

        def training_log(*args, **kwargs):
            out = log(*args, **kwargs)
            iteration = runtime.args.curr_iteration + 1
            last_rank = not _dist() or torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
            if last_rank and iteration % runtime.args.log_interval == 0:
                print(runtime.status_line(), flush=True)
            return out

        mt_training.save_checkpoint = save_checkpoint
        mt_training.training_log = training_log
        self._restore = (save, log)

    # -- the end ----------------------------------------------------------------------------
    def close(self) -> None:
        mt_training.save_checkpoint, mt_training.training_log = self._restore
        self.flush()
        self.drain.close()
        self.hooks.remove()
        self.transport.close()
        ingester = getattr(self.sink, "is_ingester", False)
        report = None if ingester else self.sink.close()
        if _dist() and torch.distributed.get_world_size() > 1:
            torch.distributed.barrier()  # every rank's spool is complete before the final ingest
        if ingester:
            report = self.sink.close()
        self._print_report(report)

    def _print_report(self, report: SinkReport) -> None:
        t = self.transport.stats
        line = (
            f"rank {self.coords.rank}: captured {t.published} records ({t.published_bytes} B), "
            f"written {report.records_written} ({report.bytes_written} B), spooled {report.records_spooled}, "
            f"dropped {t.dropped + report.records_dropped}, replays rejected {self.capture.stats.replays_rejected}"
            + (f", waited for ring space {t.blocked_seconds:.2f} s ({t.blocked} records): raise --dmi-ring-mb"
               " or see docs/troubleshooting.md" if t.blocked else "")
            + (f", errors: {'; '.join(report.errors)}" if report.errors else "")
        )
        lines = [line]
        if _dist() and torch.distributed.get_world_size() > 1:
            gathered = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, line)
            lines = gathered
        print_rank_0("DMI end-of-run report (run {} attempt {}):\n  {}".format(self.run_id, self.attempt, "\n  ".join(lines)))
