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
from megatron.core.utils import get_batch_on_this_cp_rank
from megatron.training.arguments import parse_args

from megatron.training import get_timers, inprocess_restart, pretrain
from megatron.training.dmi import entry, model_flags
from megatron.training.dmi.dataset_provider import train_valid_test_datasets_provider
from megatron.training.dmi.model_provider import get_embedding_ranks, model_provider


def get_batch(data_iterator):
    """Every rank reads its own (identical across TP) batch: the dataset provider is distributed."""
    if data_iterator is None:
        return None, None, None, None, None
    data = next(data_iterator)
    device = entry.compute_device()
    batch = {
        k: (data[k].to(device, non_blocking=True) if k in data else None)
        for k in ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
    }
    batch = get_batch_on_this_cp_rank(batch)
    return batch["tokens"], batch["labels"], batch["loss_mask"], batch["attention_mask"], batch["position_ids"]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1)
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model: GPTModel):
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    timers("batch-generator").stop()
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)


def main():
    # Before megatron.training initialises: --help, argument errors, the CPU mode or the no-GPU message.
    entry.prepare_process(sys.argv, model_flags.add_modelopt_args)
    # Model flags this entry cannot build as upstream does stop here, before any process group exists.
    model_flags.print_notices(
        model_flags.check_model_flags(
            parse_args(entry.extra_args_provider(model_flags.add_modelopt_args)), cpu=entry.CPU_DEV_FLAG in sys.argv
        )
    )
    # --inprocess-restart: megatron.training's wrapper (a warning and a plain run without
    # nvidia-resiliency-ext), with the store it creates for the restarts; DMI closes inside each attempt.
    train, store = inprocess_restart.maybe_wrap_for_inprocess_restart(entry.pretrain_with_dmi(pretrain))
    train(
        train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
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
