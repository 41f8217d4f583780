"""Launch pretrain_gpt.py with a fault in the model's per-token loss, for the loss-check tests.

``DMI_TEST_LOSS_FAULT=KIND:ITERATION`` (unset: no fault; KIND: nan, inf or spike) replaces, in every training
forward of that (1-based) iteration, the per-token loss GPTModel returns by NaN, Inf or 1000 times
itself. The fault enters at the model's output, below any entry script's loss function, so the
same launcher serves any entry that trains a GPTModel.

    python tests/unit_tests/dmi/training/loss_fault_launch.py <pretrain_gpt.py arguments>
"""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
sys.path.insert(0, REPO)

from megatron.core.models.gpt import GPTModel  # noqa: E402

from megatron.training import get_args  # noqa: E402
from megatron.training.dmi import pretrain_gpt  # noqa: E402

FAULTS = {
    # through the graph, so the step's backward still runs as it would on a real fault
    "nan": lambda loss: loss * float("nan"),
    "inf": lambda loss: loss + float("inf"),
    "spike": lambda loss: loss * 1000.0,
}


def inject(kind: str, iteration: int) -> None:
    forward = GPTModel.forward
    fault = FAULTS[kind]

    def faulty_forward(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if self.training and kwargs.get("labels") is not None and get_args().curr_iteration + 1 == iteration:
            return fault(out)
        return out

    GPTModel.forward = faulty_forward


if __name__ == "__main__":
    if os.environ.get("DMI_TEST_LOSS_FAULT"):
        kind, iteration = os.environ["DMI_TEST_LOSS_FAULT"].split(":")
        inject(kind, int(iteration))
    sys.argv[0] = os.path.join(REPO, "pretrain_gpt.py")
    pretrain_gpt.main()
