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
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.utils import get_batch_on_this_cp_rank
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.utils import get_blend_and_blend_per_split

from megatron.core import parallel_state as mpu
from megatron.training import get_args, get_timers, get_tokenizer, pretrain, print_rank_0
from megatron.training.dmi import entry


def layer_spec(args, config, vp_stage):
    use_te = args.transformer_impl == "transformer_engine"
    if args.num_experts and args.moe_layer_freq != 1:
        return get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, vp_stage=vp_stage)
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(
            args.num_experts, args.moe_grouped_gemm, args.qk_layernorm, args.multi_latent_attention
        )
    return get_gpt_layer_local_spec(
        args.num_experts,
        args.moe_grouped_gemm,
        args.qk_layernorm,
        args.multi_latent_attention,
        normalization=args.normalization,
    )


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    args = get_args()
    print_rank_0("building GPT model ...")
    config = config or core_transformer_config_from_args(args)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(args, config, vp_stage),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )


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


def dataset_config(args) -> GPTDatasetConfig:
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        data_parallel_size=mpu.get_data_parallel_world_size(),
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"building {'mock' if args.mock_data else 'indexed'} GPT datasets ...")
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, lambda: True, dataset_config(args)
    ).build()
    return train_ds, valid_ds, test_ds


# Every rank builds its own loader, so no batch broadcast over the TP group is needed.
train_valid_test_datasets_provider.is_distributed = True


def main():
    # Before megatron.training initialises: --help, argument errors, the CPU mode or the no-GPU message.
    entry.prepare_process(sys.argv)
    try:
        pretrain(
            train_valid_test_datasets_provider,
            model_provider,
            ModelType.encoder_or_decoder,
            entry.dmi_forward_step(forward_step),
            extra_args_provider=entry.extra_args_provider(),
        )
    finally:
        entry.finish()
    # Tear the process groups down while the interpreter is whole: left to exit, gloo's worker
    # threads can free tensors during finalization and abort the process (seen in CI, rarely).
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
