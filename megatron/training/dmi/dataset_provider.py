"""The datasets the training entry builds from Megatron's arguments."""

from __future__ import annotations

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.training.utils import get_blend_and_blend_per_split

from megatron.core import parallel_state as mpu
from megatron.training import get_args, get_tokenizer, print_rank_0


def dataset_config(args) -> GPTDatasetConfig:
    """The GPT dataset configuration Megatron's arguments describe."""
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
    """Build the train, validation and test datasets (mock or indexed) for ``pretrain``."""
    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"building {'mock' if args.mock_data else 'indexed'} GPT datasets ...")
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, lambda: True, dataset_config(args)
    ).build()
    return train_ds, valid_ds, test_ds


# Every rank builds its own loader, so no batch broadcast over the TP group is needed.
train_valid_test_datasets_provider.is_distributed = True
