"""The datasets the training entry builds from Megatron's arguments, as upstream's pretrain_gpt.py does.

Every data flag of upstream core_v0.17.1's entry reaches the dataset config (see
docs/parity.md): ``--sft`` selects ``SFTDataset`` (packed THD batches), ``--fim-data``
``GPTFIMDataset`` with the ``--fim-*`` options, ``--mock-data`` ``MockGPTDataset``. The datasets are
built on tensor-parallel rank 0 of the stages that read data (first, last, MTP; every stage for
packed sequences) and ``get_batch`` broadcasts each batch over the TP group, as upstream does.
"""

from __future__ import annotations

import importlib.util
import json
from functools import partial

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.object_storage_utils import get_object_storage_access, is_object_storage_path
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.datasets.fim_dataset import GPTFIMDataset, GPTFIMDatasetConfig
from megatron.training.datasets.sft_dataset import SFTDataset
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

from megatron.core import parallel_state as mpu
from megatron.training import get_args, print_rank_0
from megatron.training.dmi.arguments import refuse

# The package each object-storage scheme reads through (megatron-core imports them lazily).
OBJECT_STORAGE_PACKAGES = {"s3": "boto3", "msc": "multistorageclient"}
# The package megatron-core's tokenizer of each type is built on (optional dependencies of the wheel).
TOKENIZER_PACKAGES = {
    "GPT2BPETokenizer": "transformers",
    "BertWordPieceLowerCase": "transformers",
    "BertWordPieceCase": "transformers",
    "HuggingFaceTokenizer": "transformers",
    "SentencePieceTokenizer": "sentencepiece",
    "GPTSentencePieceTokenizer": "sentencepiece",
    "Llama2Tokenizer": "sentencepiece",
    "TikTokenizer": "tiktoken",
}


def _fim_options(args) -> dict:
    return {
        "fim_rate": args.fim_rate,
        "fim_spm_rate": args.fim_spm_rate,
        "fim_extra_tokens": {
            "prefix": args.fim_prefix_token,
            "middle": args.fim_middle_token,
            "suffix": args.fim_suffix_token,
            "pad": args.fim_pad_token,
            "eod": args.fim_eod_token,
        },
        "fim_split_sample": args.fim_split_sample,
        "fim_fragment_rate": args.fim_fragment_rate,
        "fim_no_prefix": args.fim_no_prefix,
    }


def dataset_config(args) -> GPTDatasetConfig:
    """The dataset configuration Megatron's arguments describe (``GPTFIMDatasetConfig`` with --fim-data)."""
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    sequences_per_dataset = None
    if args.per_dataset_sequences_path is not None:
        with open(args.per_dataset_sequences_path, encoding="utf-8") as f:
            sequences_per_dataset = json.load(f)
    options = dict(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        object_storage_cache_path=args.object_storage_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
        fast_cache_load=args.dataloader_fast_cache_load,
        sequences_per_dataset=sequences_per_dataset,
        defer_npy_index_mmap=args.dataloader_defer_npy_index_mmap,
        context_parallel_size=args.context_parallel_size,
        data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel,
        hybrid_context_parallel=args.hybrid_context_parallel,
    )
    if args.fim_data:
        return GPTFIMDatasetConfig(**options, **_fim_options(args))
    return GPTDatasetConfig(**options)


def dataset_type(args) -> type:
    """The dataset class upstream's entry builds for these arguments (``--sft`` wins over the rest)."""
    if args.sft:
        return SFTDataset
    if args.mock_data:
        return MockGPTDataset
    return GPTFIMDataset if args.fim_data else GPTDataset


def has_mtp_layers(args, vp_stage=None) -> bool:
    """Whether this pipeline stage (and virtual stage) holds multi-token-prediction layers, which
    read the batch's tokens and labels wherever they are."""
    # No MTP layer without --mtp-num-layers; the model config is built (and checked) only then.
    if not args.mtp_num_layers:
        return False
    return mtp_on_this_rank(core_transformer_config_from_args(args), ignore_virtual=False, vp_stage=vp_stage)


def is_dataset_built_on_rank(vp_stage=None, is_packed_sequence: bool = False) -> bool:
    """TP rank 0 of a stage that reads data: the first and last stages and MTP stages; with
    packed sequences every stage (its attention needs the sequence boundaries)."""
    if mpu.get_tensor_model_parallel_rank() != 0:
        return False
    return is_packed_sequence or is_first_or_last_pipeline_stage(vp_stage) or has_mtp_layers(get_args(), vp_stage)


def _data_paths(args) -> list[str]:
    paths = list(args.data_path or [])
    for split in (args.train_data_path, args.valid_data_path, args.test_data_path):
        paths += list(split or [])
    return [p for p in paths if isinstance(p, str)]


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def validate_data_args(args) -> None:
    """Refuse, in one line naming the flag (``FlagRefusal``), data arguments that cannot run in this
    environment; run with Megatron's argument validation, before the tokenizer, the model or any
    dataset exists.

    Each case is one where upstream's entry fails too, deep inside megatron-core (an assertion
    without a message, or an ImportError when the tokenizer or the first batch is built).
    """
    package = TOKENIZER_PACKAGES.get(args.tokenizer_type)
    if package and not _installed(package):
        refuse(
            "--tokenizer-type",
            f"{args.tokenizer_type} needs the '{package}' package, which is not installed (without the flag the "
            "tokenizer is GPT2BPETokenizer, as upstream's entry has it; NullTokenizer with --vocab-size needs no "
            "package)",
        )
    if args.sft and args.micro_batch_size != 1:
        refuse("--sft", "packed sequences need --micro-batch-size 1 (one pack of sequences a microbatch)")
    if args.sft and not _installed("datasets"):
        refuse("--sft", "SFTDataset reads jsonl through the 'datasets' package, which is not installed")
    for path in _data_paths(args):
        if not is_object_storage_path(path):
            continue
        scheme = get_object_storage_access(path)
        if args.object_storage_cache_path is None:
            refuse(
                "--data-path",
                f"{path} is in object storage ({scheme}://); give --object-storage-cache-path for its cached index files",
            )
        package = OBJECT_STORAGE_PACKAGES[scheme]
        if not _installed(package):
            refuse("--data-path", f"{path} is read through the '{package}' package, which is not installed")


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Build the train, validation and test datasets for ``pretrain``.

    With ``--multiple-validation-sets`` the validation entry is a list, one dataset per path.
    """
    args = get_args()
    config = dataset_config(args)
    cls = dataset_type(args)
    print_rank_0(f"> building train, validation, and test datasets for GPT ({cls.__name__}) ...")
    built_here = partial(is_dataset_built_on_rank, vp_stage=vp_stage, is_packed_sequence=bool(args.sft))
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        cls, train_val_test_num_samples, built_here, config
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return train_ds, valid_ds, test_ds


# Megatron builds the loaders on every rank; ranks without a dataset get batches by broadcast.
train_valid_test_datasets_provider.is_distributed = True
