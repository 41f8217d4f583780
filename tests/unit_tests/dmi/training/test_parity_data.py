"""The entry's data path against upstream core_v0.17.1's pretrain_gpt.py, flag by flag, in-process:
the dataset class and config each data flag gives, the batch fields get_batch hands the model
(plain and packed THD), the default tokenizer, forward_step's schedule-plan path and every refusal.

Datasets are real megatron-core datasets over tiny indexed files the tests write; arguments go
through megatron's own parser and validate_args with the entry's argument defaults.
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys

import numpy
import pytest
import torch
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.training.arguments import add_megatron_arguments, validate_args
from megatron.training.datasets.fim_dataset import GPTFIMDataset, GPTFIMDatasetConfig
from megatron.training.datasets.sft_dataset import SFTDataset

from megatron.core import rerun_state_machine as rerun
from megatron.training import global_vars
from megatron.training.dmi import dataset_provider, pretrain_gpt
from tests.functional_tests.launch import REPO
from tests.unit_tests.dmi.megatron_cpu import megatron_on_cpu

SEQ, VOCAB = 16, 64
TINY = (
    f"--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length {SEQ} --max-position-embeddings {SEQ} "
    "--micro-batch-size 1 --global-batch-size 1 --train-iters 4 --lr 1e-3 --seed 1234"
).split()
NULL_TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB)]
# train, valid, test sample counts as pretrain asks them for 4 iterations and 2 evaluation batches
SAMPLES = [4, 2, 2]


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def megatron_args(*argv: str) -> argparse.Namespace:
    """Megatron's parsed and validated arguments for ``argv`` (a world of one), with the entry's defaults."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    args = parser.parse_args([*TINY, *argv])
    args.rank, args.world_size = 0, 1
    validate_args(args, pretrain_gpt.ARGS_DEFAULTS)
    return args


@pytest.fixture(scope="module")
def cpu_world():
    with megatron_on_cpu():
        yield


@pytest.fixture
def use_args(cpu_world):
    """Install parsed arguments (and megatron's timers, which forward_step uses) as megatron's globals."""
    saved = global_vars._GLOBAL_ARGS, global_vars._GLOBAL_TIMERS

    def install(*argv: str) -> argparse.Namespace:
        args = megatron_args(*argv)
        global_vars.set_args(args)
        global_vars._GLOBAL_TIMERS = None
        global_vars._set_timers(args)
        return args

    yield install
    global_vars._GLOBAL_ARGS, global_vars._GLOBAL_TIMERS = saved


def write_documents(prefix: str, documents: int = 40, length: int = 24, seed: int = 0) -> str:
    """A tiny indexed dataset (.bin/.idx) of random token documents; returns its path prefix."""
    rng = numpy.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for _ in range(documents):
        builder.add_document(torch.from_numpy(rng.integers(0, VOCAB - 8, length).astype(numpy.int32)), [length])
    builder.finalize(prefix + ".idx")
    return prefix


def build(samples=SAMPLES):
    return dataset_provider.train_valid_test_datasets_provider(samples)


# -- dataset classes and their batches -------------------------------------------------------------


def test_mock_data_builds_mock_gpt_datasets_with_the_gpt_fields(use_args):
    use_args("--mock-data", *NULL_TOKENIZER)
    train, valid, _ = build()
    assert type(train) is MockGPTDataset and type(valid) is MockGPTDataset
    sample = train[0]
    assert {"tokens", "labels", "loss_mask", "position_ids"} <= set(sample)
    assert sample["tokens"].shape == (SEQ,)


def test_data_path_builds_gpt_datasets(use_args, tmp_path):
    prefix = write_documents(str(tmp_path / "docs"))
    use_args("--data-path", prefix, "--split", "90,5,5", *NULL_TOKENIZER)
    train, _, _ = build()
    assert type(train) is GPTDataset
    assert torch.equal(train[0]["labels"][:-1], train[0]["tokens"][1:])


def test_fim_data_builds_the_fim_dataset_with_the_fim_options(use_args, tmp_path):
    prefix = write_documents(str(tmp_path / "docs"))
    # the null tokenizer's tokens are decimal ids: the FIM sentinels are ids above the documents'
    fim_tokens = ["--fim-prefix-token", "60", "--fim-middle-token", "61", "--fim-suffix-token", "62"]
    fim_tokens += ["--fim-pad-token", "63", "--fim-eod-token", "64"]
    args = use_args(
        "--data-path", prefix, "--split", "90,5,5", "--fim-data", "--fim-rate", "1.0", "--fim-spm-rate", "0.5",
        *fim_tokens, *NULL_TOKENIZER,
    )  # fmt: skip
    config = dataset_provider.dataset_config(args)
    assert type(config) is GPTFIMDatasetConfig and config.fim_rate == 1.0 and config.fim_spm_rate == 0.5
    assert config.fim_extra_tokens == {"prefix": "60", "middle": "61", "suffix": "62", "pad": "63", "eod": "64"}
    train, _, _ = build()
    # drawing a FIM sample decodes text, which the null tokenizer cannot (upstream's entry neither)
    assert type(train) is GPTFIMDataset
    assert (train.prefix_tok_id, train.middle_tok_id, train.suffix_tok_id) == (60, 61, 62)


def test_sft_selects_the_sft_dataset(use_args):
    args = use_args("--mock-data", "--sft", *NULL_TOKENIZER)
    assert dataset_provider.dataset_type(args) is SFTDataset


def test_multiple_validation_sets_build_one_validation_set_per_path(use_args, tmp_path):
    train = write_documents(str(tmp_path / "train"), seed=1)
    valid = [write_documents(str(tmp_path / f"valid{i}"), seed=2 + i) for i in range(2)]
    use_args(
        "--train-data-path", train, "--valid-data-path", *valid, "--test-data-path", train,
        "--multiple-validation-sets", *NULL_TOKENIZER,
    )  # fmt: skip
    _, valid_ds, _ = build()
    assert isinstance(valid_ds, list) and len(valid_ds) == 2
    assert [ds.dataset_path for ds in valid_ds] == valid


def test_full_validation_builds_each_validation_set_whole(use_args, tmp_path):
    train = write_documents(str(tmp_path / "train"), seed=1)
    valid = [write_documents(str(tmp_path / f"valid{i}"), documents=10 + 10 * i, seed=2 + i) for i in range(2)]
    use_args(
        "--train-data-path", train, "--valid-data-path", *valid, "--test-data-path", train,
        "--multiple-validation-sets", "--full-validation", *NULL_TOKENIZER,
    )  # fmt: skip
    _, valid_ds, _ = build([4, None, 2])  # pretrain asks no validation count under --full-validation
    # one epoch of each: its tokens, less the one extra token each sample draws, in whole sequences
    assert [len(ds) for ds in valid_ds] == [(int(ds.dataset.sequence_lengths.sum()) - 1) // SEQ for ds in valid_ds]


def test_dataset_options_reach_the_dataset_config(use_args, tmp_path):
    per_dataset = tmp_path / "sequences.json"
    per_dataset.write_text(json.dumps({"prefix": [3, 3]}))
    args = use_args(
        "--mock-data", "--allow-ambiguous-pad-tokens", "--mid-level-dataset-surplus", "0.25",
        "--dataloader-fast-cache-load", "--data-cache-path", str(tmp_path / "index-cache"),
        "--dataloader-defer-npy-index-mmap",
        "--per-dataset-sequences-path", str(per_dataset), "--object-storage-cache-path", str(tmp_path / "cache"),
        "--no-create-attention-mask-in-dataloader", "--eod-mask-loss", *NULL_TOKENIZER,
    )  # fmt: skip
    config = dataset_provider.dataset_config(args)
    assert type(config) is GPTDatasetConfig
    assert config.allow_ambiguous_pad_tokens and config.mid_level_dataset_surplus == 0.25
    assert config.fast_cache_load and config.defer_npy_index_mmap
    assert config.path_to_cache == str(tmp_path / "index-cache")
    assert config.sequences_per_dataset == {"prefix": [3, 3]}
    assert config.object_storage_cache_path == str(tmp_path / "cache")
    assert not config.create_attention_mask and config.eod_mask_loss
    assert (config.context_parallel_size, config.data_parallel_size, config.sequence_parallel_size) == (1, 1, 0)
    assert config.hybrid_context_parallel is False


def test_without_tokenizer_type_the_tokenizer_is_gpt2_bpe_as_upstream():
    assert megatron_args("--mock-data").tokenizer_type == "GPT2BPETokenizer"


# -- get_batch and forward_step ---------------------------------------------------------------------


def test_get_batch_hands_the_model_the_gpt_fields_and_no_packing(use_args):
    use_args("--mock-data", *NULL_TOKENIZER)
    train, _, _ = build()
    sample = train[0]
    batch = {k: v.unsqueeze(0) for k, v in sample.items()}
    tokens, labels, loss_mask, attention_mask, position_ids, packed = pretrain_gpt.get_batch(iter([batch]))
    assert torch.equal(tokens, batch["tokens"]) and torch.equal(labels, batch["labels"])
    assert torch.equal(loss_mask, batch["loss_mask"]) and torch.equal(position_ids, batch["position_ids"])
    assert torch.equal(attention_mask, batch["attention_mask"]) and packed is None


def test_get_batch_turns_a_packed_sft_batch_into_thd_packed_seq_params(use_args):
    use_args("--mock-data", "--sft", "--no-create-attention-mask-in-dataloader", *NULL_TOKENIZER)
    # what SFTDataset yields for two conversations of 6 and 10 tokens, batched by the loader
    batch = {
        "tokens": torch.arange(SEQ).unsqueeze(0),
        "labels": torch.arange(1, SEQ + 1).unsqueeze(0),
        "loss_mask": torch.ones(1, SEQ),
        "position_ids": torch.cat([torch.arange(6), torch.arange(10)]).unsqueeze(0),
        "cu_seqlens": torch.tensor([[0, 6, SEQ]], dtype=torch.int32),
        "max_seqlen": torch.tensor([10], dtype=torch.int32),
    }
    tokens, labels, loss_mask, attention_mask, position_ids, packed = pretrain_gpt.get_batch(iter([batch]))
    assert isinstance(packed, PackedSeqParams) and packed.qkv_format == "thd"
    assert packed.cu_seqlens_q.tolist() == [0, 6, SEQ] and packed.cu_seqlens_kv.tolist() == [0, 6, SEQ]
    assert packed.max_seqlen_q == packed.max_seqlen_kv == 10
    assert attention_mask is None and torch.equal(tokens, batch["tokens"])


class _PlanRecorder(torch.nn.Module):
    """Stands in for the model chunk the combined 1F1B schedule hands forward_step: records what
    build_schedule_plan receives (the schedule itself needs expert parallelism and bf16)."""

    vp_stage = None

    def build_schedule_plan(self, *args, **kwargs):
        self.plan_inputs = (args, kwargs)
        return "plan"


def test_forward_step_returns_the_schedule_plan_for_overlap_moe_expert_parallel_comm(use_args):
    args = use_args("--mock-data", *NULL_TOKENIZER)
    args.overlap_moe_expert_parallel_comm = True  # its config checks need EP > 1 and bf16
    train, _, _ = build()
    batch = {k: v.unsqueeze(0) for k, v in train[0].items()}
    model = _PlanRecorder()
    plan, loss = pretrain_gpt.forward_step(iter([batch]), model, return_schedule_plan=True)
    assert plan == "plan" and loss.func is pretrain_gpt.loss_func and loss.keywords == {"model": model}
    (tokens, position_ids, _), kwargs = model.plan_inputs
    assert torch.equal(tokens, batch["tokens"]) and torch.equal(kwargs["labels"], batch["labels"])


def test_forward_step_builds_no_schedule_plan_without_the_flag(use_args):
    use_args("--mock-data", *NULL_TOKENIZER)
    train, _, _ = build()
    batch = {k: v.unsqueeze(0) for k, v in train[0].items()}
    with pytest.raises(ValueError, match="--overlap-moe-expert-parallel-comm"):
        pretrain_gpt.forward_step(iter([batch]), _PlanRecorder(), return_schedule_plan=True)


# -- refusals ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (
            ["--mock-data", "--sft", "--micro-batch-size", "2"],
            "argument --sft: packed sequences need --micro-batch-size 1",
        ),
        pytest.param(
            ["--mock-data", "--sft"],
            "argument --sft: SFTDataset reads jsonl through the 'datasets' package",
            marks=pytest.mark.skipif(_installed("datasets"), reason="'datasets' is installed"),
        ),
        (
            ["--data-path", "s3://bucket/docs"],
            "s3://bucket/docs is in object storage (s3://); give --object-storage-cache-path",
        ),
        (
            [
                "--train-data-path",
                "msc://profile/docs",
                "--valid-data-path",
                "msc://profile/docs",
                "--test-data-path",
                "msc://profile/docs",
            ],
            "msc://profile/docs is in object storage (msc://)",
        ),  # fmt: skip
        pytest.param(
            ["--data-path", "s3://bucket/docs", "--object-storage-cache-path", "/tmp/c"],
            "read through the 'boto3' package",
            marks=pytest.mark.skipif(_installed("boto3"), reason="boto3 is installed"),
        ),
    ],
    ids=["sft-micro-batch-2", "sft-without-datasets", "s3-without-cache", "msc-without-cache", "s3-without-boto3"],
)
def test_data_flags_that_cannot_run_are_refused_in_one_line(use_args, argv, why):
    args = use_args(*argv, *NULL_TOKENIZER)
    with pytest.raises(SystemExit) as refused:
        dataset_provider.validate_data_args(args)
    message = str(refused.value)
    assert message.startswith("error: argument --") and why in message and "\n" not in message


@pytest.mark.skipif(_installed("transformers"), reason="transformers is installed")
def test_the_default_tokenizer_without_transformers_stops_the_entry_at_start_up(tmp_path):
    tiny = TINY + ["--mock-data", "--transformer-impl", "local", "--cpu-dev-mode"]
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *tiny],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "building GPT model" not in proc.stdout  # an argument error, as argparse's
    assert last.startswith(
        "pretrain_gpt.py: error: argument --tokenizer-type: GPT2BPETokenizer needs the 'transformers' package, "
        "which is not installed"
    )


def test_loss_func_reports_the_summed_loss_and_token_count(use_args):
    use_args("--mock-data", *NULL_TOKENIZER)
    saved = rerun._GLOBAL_RERUN_STATE_MACHINE
    # outside a training step the machine must be off; off, it still rejects a NaN (fatal)
    rerun._GLOBAL_RERUN_STATE_MACHINE = rerun.RerunStateMachine(mode=rerun.RerunMode.DISABLED)
    try:
        per_token, mask = torch.tensor([[1.0, 2.0, 4.0]]), torch.tensor([[1.0, 0.0, 1.0]])
        loss, tokens, report = pretrain_gpt.loss_func(mask, per_token)
        assert loss.item() == 5.0 and tokens.item() == 2
        assert report["lm loss"].tolist() == [5.0, 2.0]
        with pytest.raises(RuntimeError, match="found NaN in local forward loss calculation"):
            pretrain_gpt.loss_func(torch.ones(1, 3), torch.tensor([[1.0, float("nan"), 1.0]]))
    finally:
        rerun._GLOBAL_RERUN_STATE_MACHINE = saved
