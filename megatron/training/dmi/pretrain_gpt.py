"""Pretrain a GPT (dense or MoE) with megatron-core 0.17.1, with Deep Model Inspection built in.

    torchrun --nproc-per-node N -m megatron.training.dmi.pretrain_gpt <usual Megatron args> \
        --dmi-hooks router,attn --dmi-persist clickhouse

The same entry is installed as the ``megatron-dmi-pretrain-gpt`` console script, and the
repository's ``pretrain_gpt.py`` is a thin wrapper over it. With no --dmi-* flag this trains
exactly like upstream: DMI installs nothing. ``--cpu-dev-mode`` runs a (tiny) model on a machine
without a GPU, for trying DMI out and for CI.
"""

from __future__ import annotations

import sys
from functools import partial

import torch
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.utils import (
    StragglerDetector,
    get_attr_wrapped_model,
    get_batch_on_this_hybrid_cp_rank,
    get_thd_batch_on_this_cp_rank,
)
from megatron.training.arguments import parse_args
from megatron.training.utils import (
    get_batch_on_this_cp_rank,
    get_batch_on_this_tp_rank,
    is_first_or_last_pipeline_stage,
)

from megatron.core.dmi.errors import InvalidArgumentError
from megatron.training import get_args, get_timers, inprocess_restart, pretrain
from megatron.training.dmi import dataset_provider, entry, model_flags
from megatron.training.dmi.dataset_provider import has_mtp_layers, train_valid_test_datasets_provider
from megatron.training.dmi.model_provider import get_embedding_ranks, model_provider

# Upstream's entry hands these to ``pretrain``: without --tokenizer-type it is GPT-2's BPE.
ARGS_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}
# A loss this many times the largest seen so far is "spiky" (--check-for-spiky-loss).
SPIKY_LOSS_FACTOR = 10
# The straggler detector is a process-wide singleton (--log-straggler): the batch read is timed
# as data time, the forward as compute time, as upstream's entry does.
stimer = StragglerDetector()


def _packed_seq_params_for_middle_stage(cu_seqlens, max_seqlen) -> PackedSeqParams:
    longest = int(max_seqlen[0].item())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def get_batch(data_iterator, vp_stage=None):
    """This rank's batch: tokens, labels, loss_mask, attention_mask, position_ids, packed_seq_params.

    TP rank 0 reads the loader and broadcasts over the TP group; the batch is then cut for context
    parallelism: by halves of the sequence (plain batches), by packed sub-sequences (``--sft``'s
    THD batches, which carry ``cu_seqlens``) or by the loader's local CP size (hybrid CP). Stages
    with no use for data (not first, last or MTP) get ``None`` fields; with packed sequences they
    still get the sequence boundaries their attention needs.
    """
    args = get_args()
    packed = bool(args.sft)
    mtp_here = has_mtp_layers(args, vp_stage)
    reads_data = is_first_or_last_pipeline_stage(vp_stage)
    if not reads_data and not packed and not mtp_here:
        return None, None, None, None, None, None
    batch = get_batch_on_this_tp_rank(data_iterator, mtp_on_this_rank=mtp_here)
    cu_seqlens = batch.pop("cu_seqlens", None)
    cu_seqlens_padded = batch.pop("cu_seqlens_padded", None)
    max_seqlen = batch.pop("max_seqlen", None)
    local_cp_size = batch.pop("local_cp_size", None)
    if cu_seqlens is not None:  # [1, S+1]: one packed sequence a microbatch (see data_flag_problem)
        cu_seqlens = cu_seqlens[0]
    if not reads_data and packed:
        return None, None, None, None, None, _packed_seq_params_for_middle_stage(cu_seqlens, max_seqlen)
    if local_cp_size is not None:
        batch, packed_seq_params = get_batch_on_this_hybrid_cp_rank(batch, int(local_cp_size.item()))
    elif cu_seqlens is not None:
        batch, packed_seq_params = get_thd_batch_on_this_cp_rank(batch, cu_seqlens, cu_seqlens_padded, max_seqlen)
    else:
        batch, packed_seq_params = get_batch_on_this_cp_rank(batch), None
    return (*batch.values(), packed_seq_params)


def _check_loss(loss: torch.Tensor, args) -> None:
    """The rerun state machine's checks of this rank's loss, before any data-parallel reduction:
    NaN and Inf (fatal; on unless --no-check-for-nan-in-loss-and-grad) and, with
    --check-for-spiky-loss, a loss far above the largest seen so far (not fatal)."""
    machine = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        for rejected, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(
                result=loss,
                rejection_func=rejected,
                message=f"found {what} in local forward loss calculation",
                tolerance=0.0,  # the forward pass is deterministic: a rerun must match exactly
                fatal=True,
            )
    if args.check_for_spiky_loss:
        machine.validate_result(
            result=loss,
            rejection_func=partial(machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss"),
            message="Spiky loss",
            tolerance=0.0,
            fatal=False,
        )


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model: GPTModel | None = None):
    """The microbatch's summed token loss, its token count and the ``lm loss`` report; with
    ModelOpt enabled (its flags exist only where megatron.post_training is installed), ModelOpt's
    loss, which reads the distillation losses off ``model``."""
    args = get_args()
    if getattr(args, "modelopt_enabled", False):
        from megatron.post_training.loss_func import loss_func as modelopt_loss_func

        loss, num_tokens, report = modelopt_loss_func(loss_mask, output_tensor, model=model)
    else:
        losses = output_tensor.view(-1).float()
        loss_mask = loss_mask.view(-1).float()
        loss = torch.sum(losses * loss_mask)
        num_tokens = loss_mask.sum().clone().detach().to(torch.int)
        report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    _check_loss(loss, args)
    return loss, num_tokens, report


def forward_step(data_iterator, model: GPTModel, return_schedule_plan: bool = False):
    """One microbatch's forward: the output tensor (or, for --overlap-moe-expert-parallel-comm's
    combined 1F1B schedule, the model's schedule plan) and the loss function to apply to it."""
    args = get_args()
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    with stimer(bdata=True):
        vp_stage = get_attr_wrapped_model(model, "vp_stage")
        tokens, labels, loss_mask, attention_mask, position_ids, packed_seq_params = get_batch(data_iterator, vp_stage)
    timers("batch-generator").stop()
    loss = partial(loss_func, loss_mask, model=model)  # the module's loss_func at call time (tests replace it)
    with stimer:
        if return_schedule_plan:
            if not args.overlap_moe_expert_parallel_comm:
                raise InvalidArgumentError("a schedule plan is built only with --overlap-moe-expert-parallel-comm")
            plan = model.build_schedule_plan(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
            return plan, loss
        output_tensor = model(
            tokens,
            position_ids,
            attention_mask,
            labels=labels,
            loss_mask=loss_mask,
            packed_seq_params=packed_seq_params,
        )
    return output_tensor, loss


def main():
    # Before megatron.training initialises: --help, argument errors, the CPU mode or the no-GPU message.
    entry.prepare_process(sys.argv, model_flags.add_modelopt_args)
    # Flags this entry cannot honour as upstream does stop here, as argparse errors, before any process group exists.
    args = parse_args(entry.extra_args_provider(model_flags.add_modelopt_args))
    with entry.flag_refusals_as_usage_errors():
        model_flags.print_notices(model_flags.check_model_flags(args, cpu=entry.CPU_DEV_FLAG in sys.argv))
        for name, value in ARGS_DEFAULTS.items():  # as Megatron's validation applies pretrain's args_defaults
            if getattr(args, name, None) is None:
                setattr(args, name, value)
        dataset_provider.validate_data_args(args)
    # --inprocess-restart: megatron.training's wrapper (a warning and a plain run without
    # nvidia-resiliency-ext), with the store it creates for the restarts; DMI closes inside each attempt.
    train, store = inprocess_restart.maybe_wrap_for_inprocess_restart(entry.pretrain_with_dmi(pretrain))
    train(
        train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        args_defaults=ARGS_DEFAULTS,
        extra_args_provider=model_flags.add_modelopt_args,
        get_embedding_ranks=get_embedding_ranks,
        store=store,
    )
    # Tear the process groups down while the interpreter is whole: left to exit, gloo's worker
    # threads can free tensors during finalization and abort the process (seen in CI, rarely).
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
