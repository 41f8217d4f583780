"""Launch pretrain_gpt.py so that it stops at the start of chosen training iterations until the
test lets it go: live-read tests then look at a run that is certainly still training, whatever the
speed of the machine.

    DMI_PAUSE_AT=40,80 DMI_PAUSE_DIR=<dir> python tests/unit_tests/dmi/training/paused_launch.py <args>

At each pause iteration n it flushes DMI (everything captured in iterations 1..n-1 is then in
closed spool segments or the store), creates ``<dir>/paused-<n>`` and waits for ``<dir>/resume-<n>``.
"""

import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
sys.path.insert(0, REPO)

from megatron.training.dmi import pretrain_gpt  # noqa: E402  (its main() prepares the process as a real run)
from megatron.training.dmi import runtime as dmi_runtime  # noqa: E402

PAUSES = {int(x) for x in os.environ["DMI_PAUSE_AT"].split(",")}
SIGNALS = os.environ["DMI_PAUSE_DIR"]
_paused: set[int] = set()
_before_forward = dmi_runtime.DMIRuntime.before_forward


def before_forward(self, model):
    iteration = self.args.curr_iteration + 1
    if model.training and iteration in PAUSES and iteration not in _paused:
        _paused.add(iteration)
        self.flush()
        open(os.path.join(SIGNALS, f"paused-{iteration}"), "w").close()
        while not os.path.exists(os.path.join(SIGNALS, f"resume-{iteration}")):
            time.sleep(0.05)
    return _before_forward(self, model)


if __name__ == "__main__":
    dmi_runtime.DMIRuntime.before_forward = before_forward
    sys.argv[0] = os.path.join(REPO, "pretrain_gpt.py")
    pretrain_gpt.main()
