"""Launch pretrain_gpt.py and SIGKILL it at one point around a checkpoint save (issue 17 item 3).

    DMI_CRASH=<point> DMI_CRASH_ITER=<n> python tests/fault_tests/crash_launch.py <pretrain_gpt.py args>

Points (each prints ``CRASH <point> at iteration <n>`` just before ``kill -9`` of this process):

- ``before_save``: DMI's save wrapper is entered for checkpoint n; nothing of the save has run.
- ``after_megatron_save``: Megatron's save_checkpoint returned for checkpoint n (the checkpoint
  and its tracker file are on disk); whatever DMI does after Megatron's save has not run.
- ``after_save``: DMI's whole save wrapper returned for checkpoint n.
- ``during_close``: the training ended and DMI's close has started: its drain has just closed, the
  sink's close (the final ingest) has not run (n is unused).
"""

import os
import signal
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import megatron.training.training as mt_training  # noqa: E402

import pretrain_gpt  # noqa: E402  (its import prepares the process exactly as a real run)
from megatron.core.dmi.drain import Drain  # noqa: E402
from megatron.training.dmi import runtime as dmi_runtime  # noqa: E402

POINT = os.environ.get("DMI_CRASH", "")
AT = int(os.environ.get("DMI_CRASH_ITER", "4"))


def _kill() -> None:
    print(f"CRASH {POINT} at iteration {AT}: kill -9 now", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_around(fn, before: bool):
    def wrapper(iteration, *args, **kwargs):
        if before and iteration == AT:
            _kill()
        out = fn(iteration, *args, **kwargs)
        if not before and iteration == AT:
            _kill()
        return out

    return wrapper


def _install() -> None:
    if POINT == "after_megatron_save":
        # DMI's wrapper calls whatever save_checkpoint it finds when it patches the loop: this one.
        mt_training.save_checkpoint = _kill_around(mt_training.save_checkpoint, before=False)
    elif POINT in ("before_save", "after_save"):
        patch = dmi_runtime.DMIRuntime._patch_training_loop

        def patch_then_wrap(self):
            patch(self)
            mt_training.save_checkpoint = _kill_around(mt_training.save_checkpoint, before=POINT == "before_save")

        dmi_runtime.DMIRuntime._patch_training_loop = patch_then_wrap
    elif POINT == "during_close":
        close = Drain.close

        def close_then_kill(self, *args, **kwargs):
            close(self, *args, **kwargs)
            _kill()

        Drain.close = close_then_kill
    else:
        raise SystemExit(f"unknown DMI_CRASH {POINT!r}")


if __name__ == "__main__":
    if POINT:
        _install()
    sys.argv[0] = os.path.join(REPO, "pretrain_gpt.py")
    pretrain_gpt.main()
