"""DMIRuntime: DMI inside ``pretrain_gpt.py``'s training process, a client of the core
``DMISession`` (megatron/core/dmi/session.py).

Started when Megatron's ``train()`` is entered (model built, checkpoint loaded, process groups up),
it opens a session from the ``--dmi-*`` arguments, feeds it the step context from the schedule
(iteration from ``args.curr_iteration``), flushes it and saves its state with every checkpoint,
prints DMI's line at each log interval, and closes it at the end with an end-of-run report. What
lives here is only what ``megatron.training`` offers no hook for.
"""

from __future__ import annotations

import atexit
import json
import os

import torch
from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

from megatron.core.dmi import upstream_patches
from megatron.core.dmi.config import DMIConfig, ring_memory_problem
from megatron.core.dmi.cpu_mode import compute_device
from megatron.core.dmi.session import DMISession
from megatron.core.dmi.sinks.owner import StoreInUseError
from megatron.training import get_args, print_rank_0
from megatron.training.dmi.arguments import config_from_args, refuse
from megatron.training.dmi.scalars import RouterScalars
from megatron.training.dmi.scalars import wanted as scalars_wanted
from megatron.training.dmi.signals import SignalSeal, handled_signals, seal_seconds

STATE_FILE = "dmi_state_iter_{:07d}.json"


def _dist() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class DMIRuntime:
    """DMI in this training process: one per process, made by the first ``start``."""

    _instance: DMIRuntime | None = None

    @classmethod
    def start(cls, model=None) -> DMIRuntime:
        """Start DMI for the model chunks of this rank (a module or a list, one per virtual pipeline
        stage). Every rank must call it at the same point: it runs collectives."""
        if cls._instance is None:
            cls._instance = cls(config_from_args(get_args()))
        if model is not None:
            cls._instance.session.attach(model)
        return cls._instance

    @classmethod
    def shutdown(cls) -> None:
        """Close the process's runtime, if started (registered with ``atexit``)."""
        if cls._instance is not None:
            cls._instance.close()
            cls._instance = None

    def __init__(self, config: DMIConfig):
        """Start this process's DMI session from ``config`` and hook into Megatron's checkpoint saves and training
        log. Raises FlagRefusal when host or device memory cannot hold the ring, and ends the process
        (SystemExit) when another run writes the store."""
        args = get_args()
        self.config = config
        self.args = args
        resumed_from = args.iteration if (args.load and args.iteration) else None
        why = ring_memory_problem(config.ring_mb)  # again now that CUDA is initialised: the device's free memory
        if why:
            refuse("--dmi-ring-mb", why)
        try:
            self.session = DMISession(
                config,
                resumed_run_id=self._resumed_run_id(resumed_from),
                resumed_from_iteration=resumed_from,
                device=compute_device(),
                cuda_graphs=getattr(args, "cuda_graph_impl", "none") != "none",
                run_facts={
                    "seq_length": getattr(args, "seq_length", None),
                    "vocab_size": getattr(args, "padded_vocab_size", None),
                    "micro_batch_size": getattr(args, "micro_batch_size", None),
                    "global_batch_size": getattr(args, "global_batch_size", None),
                },
            )
        except StoreInUseError as exc:  # a second run on this store: one line, no traceback
            raise SystemExit(f"error: {exc}") from None
        self.run_id, self.attempt = self.session.run_id, self.session.attempt
        self.scalars = self._router_scalars() if scalars_wanted(args, config.hooks) else None
        self._patch_training_loop()
        atexit.register(DMIRuntime.shutdown)
        self.signals = SignalSeal(self._close, seal_seconds())
        self.signals.install(handled_signals(args.exit_signal_handler, args.exit_signal))
        print_rank_0(self.session.description)

    def _router_scalars(self) -> RouterScalars:
        """TensorBoard/W&B scalars from the router outputs this run captures (see scalars.py)."""
        args, config = self.args, self.config
        scalars = RouterScalars(
            args.num_layers,
            args.num_experts,
            args.moe_router_score_function,
            compute_device(),
            lambda first, last: sum(config.captures_iteration("train", i) for i in range(first, last + 1)),
            start_iteration=args.iteration,
        )
        self.session.capture.observers.append(scalars.observe)
        return scalars

    def _resumed_run_id(self, iteration: int | None) -> str | None:
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
            json.dump(self.session.state(iteration), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)

    # -- the training loop ------------------------------------------------------------------
    def end_training(self) -> None:
        """The training loop returned (or raised): later forwards (pretrain's final evaluations) are not captured."""
        self.signals.at_safe_point()
        self.session.end_capture()

    def before_forward(self, model: torch.nn.Module) -> None:
        """Tell the session that a forward of ``model`` is about to run in the current (1-based) iteration."""
        # Megatron sets curr_iteration to the number of completed iterations before each step; the
        # evaluation after step N runs with it unchanged, so it belongs to iteration N too.
        # Evaluation continues the microbatch count over its eval-iters batches.
        self.signals.at_safe_point()
        self.session.before_forward(model, self.args.curr_iteration + 1)

    def flush(self) -> None:
        """Wait until every record captured so far is durable (``DMISession.flush``); a checkpoint save
        after a signal does not come: the process seals and ends first."""
        self.signals.at_safe_point()
        self.session.flush()

    def _patch_training_loop(self) -> None:
        """Checkpoint saves flush DMI and store its state; the log interval prints DMI's line (the
        ``runtime`` group of ``upstream_patches``, undone in ``close``)."""
        upstream_patches.install("runtime")

    def _log_interval(self) -> None:
        """After Megatron's training log: at each log interval, the scalars (every rank joins their
        reduce) and DMI's line (on the last rank, where Megatron logs)."""
        self.signals.at_safe_point()
        iteration = self.args.curr_iteration + 1
        if iteration % self.args.log_interval:
            return
        if self.scalars is not None:
            self.scalars.write(iteration, get_tensorboard_writer(), get_wandb_writer())
        if not _dist() or torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
            print(self.session.status_line(), flush=True)

    # -- the end ----------------------------------------------------------------------------
    def close(self) -> None:
        """Close the session and print its end-of-run report on rank 0; after SIGTERM/SIGINT, seal this
        rank, print its report and end the process (``signals.py``). Idempotent."""
        self.signals.close_once()

    def _close(self) -> None:
        """``close``'s work, run once by ``SignalSeal``, possibly on the watchdog's thread after a signal."""
        if self.signals.signum is None:
            upstream_patches.restore("runtime")
            print_rank_0(self.session.close().text)
            return
        report = self.session.seal()
        print(
            f"DMI report at {self.signals.signal_name} (run {self.run_id} attempt {self.attempt}; this rank "
            f"sealed in {self.signals.elapsed():.1f} s, its own records only):\n  "
            + "\n  ".join(report.lines)
            + f"\n  {self.session.where()}",
            flush=True,
        )


def save_checkpoint_with_dmi_state(save_checkpoint):
    """Megatron's ``save_checkpoint`` after DMI's flush and state file (a ``runtime`` patch)."""

    def save(iteration, *args, **kwargs):
        runtime = DMIRuntime._instance
        if runtime is not None:
            runtime.flush()
            # The state file goes first: a checkpoint that exists (whatever the crash point) always
            # has its run identity beside it, so its resume continues this run. A state file whose
            # checkpoint never completed is harmless: nothing resumes from that iteration.
            runtime._write_state(iteration)
        return save_checkpoint(iteration, *args, **kwargs)

    return save


def training_log_with_dmi(training_log):
    """Megatron's ``training_log``, then DMI's line and scalars at the log interval (a ``runtime`` patch)."""

    def log(*args, **kwargs):
        out = training_log(*args, **kwargs)
        if DMIRuntime._instance is not None:
            DMIRuntime._instance._log_interval()
        return out

    return log
