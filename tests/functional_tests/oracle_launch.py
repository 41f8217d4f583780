"""Launch pretrain_gpt.py with an independent oracle: plain PyTorch forward hooks on the same
TopKRouters that copy what the router decided synchronously, keyed by (iteration, microbatch,
layer), written to $DMI_ORACLE_OUT/oracle-rank<R>.pt at exit. Used by tests to compare DMI's stored
records bitwise with what the model really computed in the same run.

    python tests/functional_tests/oracle_launch.py <pretrain_gpt.py arguments>
"""

import atexit
import collections
import os
import runpy
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import pretrain_gpt  # noqa: E402  (its import prepares the process exactly as a real run)

from megatron.core.transformer.moe.router import TopKRouter  # noqa: E402
from megatron.training import get_args  # noqa: E402

oracle: dict[tuple, dict[str, torch.Tensor]] = {}
calls: collections.Counter = collections.Counter()


def router_oracle(router, args, output):
    if not router.training or torch._C._current_graph_task_id() != -1:
        return  # evaluation and recompute replays are not the original training forward
    iteration = get_args().curr_iteration + 1
    layer = router.layer_number - 1
    microbatch = calls[(iteration, layer)]
    calls[(iteration, layer)] += 1
    probs, routing_map = output
    with torch.no_grad():
        logits = router.gating(args[0])
    oracle[(iteration, microbatch, layer)] = {
        "router.logits": logits.reshape(-1, logits.shape[-1]).detach().cpu().clone(),
        "probs": probs.detach().cpu().clone(),
        "routing_map": routing_map.detach().cpu().clone(),
    }


upstream_model_provider = pretrain_gpt.model_provider


def model_provider(*args, **kwargs):
    model = upstream_model_provider(*args, **kwargs)
    for m in model.modules():
        if isinstance(m, TopKRouter):
            m.register_forward_hook(router_oracle)
    return model


def save():
    out = os.environ["DMI_ORACLE_OUT"]
    os.makedirs(out, exist_ok=True)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    torch.save(oracle, os.path.join(out, f"oracle-rank{rank}.pt"))


if __name__ == "__main__":
    atexit.register(save)
    pretrain_gpt.model_provider = model_provider
    sys.argv[0] = os.path.join(REPO, "pretrain_gpt.py")
    pretrain_gpt.main()
