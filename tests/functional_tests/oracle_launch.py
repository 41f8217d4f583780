"""Launch pretrain_gpt.py for tests, with two optional extras (both off unless their variable is set):

* ``DMI_ORACLE_OUT``: an independent oracle: plain PyTorch forward hooks on the same TopKRouters
  and core-attention modules, and on the transformer layers themselves (their input, their output
  and their MLP block's output: DMI takes the residual stream at the layer's input norm and the
  block's final norm instead), that copy what the model computed synchronously, keyed by
  (iteration, microbatch, layer), gathered to the full tensor over the tensor-parallel group with a
  collective inside the hook when the layout shards it (sequence parallelism for token rows, heads
  for attention), and written to $DMI_ORACLE_OUT/oracle-rank<R>.pt at exit. The per-token loss and
  its mask are taken where the training step consumes them: pretrain_gpt's loss function. Gradients
  (DMI's ``grad`` group) come from plain PyTorch backward hooks: a full backward pre-hook on the
  core attention (its output's gradient) and tensor hooks on each layer's input and on each router's
  gating output, keyed by the order of their backwards (a chunk's microbatches run backward in the
  order of their forwards). Tests compare DMI's
  reconstructed records bitwise with what the model really computed in the same run.
* ``DMI_TEST_KILL_AFTER_ITER=N``: the process kills itself with SIGKILL right after Megatron logs
  iteration N (a crash with no clean-up: what DMI had not flushed is lost, as in a real failure).

    python tests/functional_tests/oracle_launch.py <pretrain_gpt.py arguments>
"""

import atexit
import collections
import os
import signal
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import megatron.training.training as mt_training  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.transformer.moe.router import TopKRouter  # noqa: E402
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock  # noqa: E402
from megatron.core.transformer.transformer_layer import TransformerLayer  # noqa: E402

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.training import get_args  # noqa: E402
from megatron.training.dmi import pretrain_gpt  # noqa: E402  (its main() prepares the process as a real run)

oracle: dict[tuple, dict[str, torch.Tensor]] = {}
calls: collections.Counter = collections.Counter()


def _training_forward(module) -> bool:
    # evaluation, recompute replays (inside backward) and pretrain's final evaluations are not the
    # original training forward of a step
    return module.training and torch._C._current_graph_task_id() == -1


def _gather_tp(t: torch.Tensor, dim: int) -> torch.Tensor:
    """All-gather over the tensor-parallel group (a collective: every TP rank runs this hook)."""
    size = ps.get_tensor_model_parallel_world_size()
    if size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    torch.distributed.all_gather(parts, t.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


def _slot(layer: int) -> tuple[int, int]:
    iteration = get_args().curr_iteration + 1
    microbatch = calls[(iteration, layer)]
    calls[(iteration, layer)] += 1
    return iteration, microbatch


def router_oracle(router, args, output):
    if not _training_forward(router):
        return
    layer = router.layer_number - 1
    iteration, microbatch = _slot(layer)
    probs, routing_map = output
    with torch.no_grad():
        logits = router.gating(args[0])
        logits = logits.reshape(-1, logits.shape[-1])
        if router.config.sequence_parallel:  # each TP rank routed its own sequence shard
            logits, probs, routing_map = (_gather_tp(x, 0) for x in (logits, probs, routing_map))
    entry = oracle.setdefault((iteration, microbatch, layer), {})
    if microbatch == 0:  # the weight this iteration's forwards use
        entry["router.weight"] = router.weight.detach().cpu().clone()
    entry.update(
        {
            "router.logits": logits.detach().cpu().clone(),
            "probs": probs.detach().cpu().clone(),
            "routing_map": routing_map.detach().cpu().clone(),
        }
    )


def attention_oracle(layer_number):
    def hook(module, args, output):
        if not _training_forward(module):
            return
        layer = layer_number - 1
        iteration = get_args().curr_iteration + 1
        microbatch = attn_calls[(iteration, layer)]
        attn_calls[(iteration, layer)] += 1
        context = output[0] if isinstance(output, tuple) else output
        with torch.no_grad():  # heads are split over TP ranks: the context's last dim, q/k's second last
            seen = {
                "attn.context": _gather_tp(context.detach(), -1),
                "attn.q": _gather_tp(args[0].detach(), -2),
                "attn.k": _gather_tp(args[1].detach(), -2),
            }
        oracle.setdefault((iteration, microbatch, layer), {}).update({o: t.cpu().clone() for o, t in seen.items()})

    return hook


attn_calls: collections.Counter = collections.Counter()
layer_calls: collections.Counter = collections.Counter()


def layer_oracles(layer_module):
    """The layer's input hidden states, its attention and MLP blocks' outputs and (last layer) its output, gathered
    over TP under sequence parallelism (each TP rank holds its own sequence shard)."""
    layer = layer_module.layer_number - 1
    sequence_parallel = layer_module.config.sequence_parallel
    last = layer_module.layer_number == layer_module.config.num_layers

    def keep(kind: str, output: str, t: torch.Tensor, module) -> None:
        if not _training_forward(module):
            return
        iteration = get_args().curr_iteration + 1
        microbatch = layer_calls[(kind, iteration, layer)]
        layer_calls[(kind, iteration, layer)] += 1
        with torch.no_grad():
            t = _gather_tp(t.detach(), 0) if sequence_parallel else t.detach()
        oracle.setdefault((iteration, microbatch, layer), {})[output] = t.cpu().clone()

    def layer_input(module, args, kwargs):
        keep("in", "resid.in", kwargs["hidden_states"], module)

    def layer_output(module, args, output):
        keep("out", "resid.out", output[0], module)

    def mlp_output(module, args, output):
        keep("mlp", "mlp.out", output[0], module)

    def attention_output(module, args, output):
        keep("attn_out", "attn.out", output[0], module)

    layer_module.register_forward_pre_hook(layer_input, with_kwargs=True)
    layer_module.self_attention.register_forward_hook(attention_output)
    layer_module.mlp.register_forward_hook(mlp_output)
    if getattr(layer_module.mlp, "shared_experts", None) is not None:
        layer_module.mlp.shared_experts.register_forward_hook(
            lambda module, args, output: keep("shared", "mlp.shared", output, module)
        )
    if last:
        layer_module.register_forward_hook(layer_output)


grad_calls: collections.Counter = collections.Counter()


def gradient_oracles(layer_module):
    """dL/d(layer input), dL/d(core-attention output) and dL/d(router logits) of each training step's
    backward, gathered over TP like their forward values (collectives inside backward hooks: every
    TP rank runs the same backward graph, so the same hooks in the same order)."""
    layer = layer_module.layer_number - 1
    sequence_parallel = layer_module.config.sequence_parallel

    def keep(output: str, gradient: torch.Tensor, dim: int | None) -> None:
        iteration = get_args().curr_iteration + 1
        microbatch = grad_calls[(output, iteration, layer)]
        grad_calls[(output, iteration, layer)] += 1
        with torch.no_grad():
            if output == "grad.router_logits":  # [tokens, experts], as DMI stores router logits
                gradient = gradient.reshape(-1, gradient.shape[-1])
            gradient = _gather_tp(gradient.detach(), dim) if dim is not None else gradient.detach()
        oracle.setdefault((iteration, microbatch, layer), {})[output] = gradient.cpu().clone()

    def watch(output: str, tensor: torch.Tensor, dim: int | None, module) -> None:
        if _training_forward(module) and tensor.requires_grad:
            tensor.register_hook(lambda gradient: keep(output, gradient, dim))

    def layer_input(module, args, kwargs):
        watch("grad.resid_in", kwargs["hidden_states"], 0 if sequence_parallel else None, module)

    def attention_output(module, grad_output):
        if module.training:
            keep("grad.attn_context", grad_output[0], -1)

    layer_module.register_forward_pre_hook(layer_input, with_kwargs=True)
    layer_module.self_attention.core_attention.register_full_backward_pre_hook(attention_output)
    router = getattr(layer_module.mlp, "router", None)
    if isinstance(router, TopKRouter):
        gating = router.gating

        def gating_with_hook(x):
            logits = gating(x)
            watch("grad.router_logits", logits, 0 if sequence_parallel else None, router)
            return logits

        router.gating = gating_with_hook


upstream_model_provider = pretrain_gpt.model_provider


def model_provider(*args, **kwargs):
    model = upstream_model_provider(*args, **kwargs)
    # DMI does not capture the multi-token-prediction block's layers; neither does the oracle
    in_mtp = {id(x) for blk in model.modules() if isinstance(blk, MultiTokenPredictionBlock) for x in blk.modules()}
    for m in model.modules():
        if id(m) in in_mtp:
            continue
        if isinstance(m, TopKRouter):
            m.register_forward_hook(router_oracle)
        if isinstance(m, TransformerLayer) and getattr(m.self_attention, "core_attention", None) is not None:
            m.self_attention.core_attention.register_forward_hook(attention_oracle(m.layer_number))
        if isinstance(m, TransformerLayer):
            layer_oracles(m)
            gradient_oracles(m)
        if isinstance(m, GPTModel) and m.post_process:
            logits_oracles(m)
    return model


loss_calls: collections.Counter = collections.Counter()
upstream_loss_func = pretrain_gpt.loss_func


def loss_oracle(loss_mask, output_tensor, *args, **kwargs):
    """[s, b, 2]: the per-token loss the step reduces and its mask (evaluation steps excluded)."""
    if torch.is_grad_enabled():  # training steps run forward with grad; evaluation runs without
        args_ = get_args()
        iteration = args_.curr_iteration + 1
        microbatch = loss_calls[iteration]
        loss_calls[iteration] += 1
        with torch.no_grad():
            loss = torch.stack([output_tensor.detach().float().t(), loss_mask.detach().float().t()], dim=-1)
        oracle.setdefault((iteration, microbatch, args_.num_layers - 1), {})["loss.token"] = loss.cpu().clone()
    return upstream_loss_func(loss_mask, output_tensor, *args, **kwargs)


def logits_oracles(model):
    """The output layer's logits of each training forward, gathered over the TP group (each rank
    holds a vocabulary shard), with the forward's labels as [s, b]."""
    labels_seen = {}

    def take_labels(module, args, kwargs):
        labels_seen["labels"] = kwargs.get("labels")

    def logits_hook(module, args, output):
        labels = labels_seen.pop("labels", None)
        if labels is None or not _training_forward(module):
            return
        args_ = get_args()
        iteration = args_.curr_iteration + 1
        microbatch = layer_calls[("logits", iteration)]
        layer_calls[("logits", iteration)] += 1
        with torch.no_grad():
            logits = _gather_tp(output[0].detach(), -1)
        oracle.setdefault((iteration, microbatch, args_.num_layers - 1), {}).update(
            logits=logits.cpu().clone(), labels=labels.t().cpu().clone()
        )

    model.register_forward_pre_hook(take_labels, with_kwargs=True)
    model.output_layer.register_forward_hook(logits_hook)


def kill_after(iteration: int) -> None:
    log = mt_training.training_log

    def training_log(*args, **kwargs):
        out = log(*args, **kwargs)
        if get_args().curr_iteration + 1 >= iteration:
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    mt_training.training_log = training_log


def save():
    out = os.environ["DMI_ORACLE_OUT"]
    os.makedirs(out, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))  # the process group is gone by now (pretrain_gpt.main)
    torch.save(oracle, os.path.join(out, f"oracle-rank{rank}.pt"))


if __name__ == "__main__":
    if os.environ.get("DMI_ORACLE_OUT"):
        atexit.register(save)
        pretrain_gpt.model_provider = model_provider
        pretrain_gpt.loss_func = loss_oracle
    if os.environ.get("DMI_TEST_KILL_AFTER_ITER"):
        kill_after(int(os.environ["DMI_TEST_KILL_AFTER_ITER"]))
    sys.argv[0] = os.path.join(REPO, "pretrain_gpt.py")
    pretrain_gpt.main()
