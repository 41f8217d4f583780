"""A user's own entry script, written without anything of DMI: its own model provider (a GPT from
megatron-core's local layer spec), its own mock-data provider, forward step and loss, and a flag of
its own (``--greeting``), all handed to ``megatron.training.pretrain``. test_launch.py runs it
through ``python -m megatron.training.dmi.launch``.

It prints one line before ``pretrain`` (its argv and which DMI modules the process holds) and one
after (its own flag's value, and whether ``pretrain`` was the launcher's replacement), so a test can
see what the launcher did to it.
"""

import sys
from functools import partial

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.training.arguments import core_transformer_config_from_args

from megatron.training import get_args, get_tokenizer, pretrain


def dmi_modules() -> list[str]:
    return sorted(m for m in sys.modules if m.startswith(("megatron.core.dmi", "megatron.training.dmi.")))


def build_model(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    args = get_args()
    return GPTModel(
        config=config or core_transformer_config_from_args(args),
        transformer_layer_spec=get_gpt_layer_local_spec(args.num_experts, moe_grouped_gemm=False),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )


def build_datasets(num_samples, vp_stage=None):
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None,
        split="1,0,0",
        tokenizer=get_tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    return BlendedMegatronDatasetBuilder(MockGPTDataset, num_samples, lambda: True, config).build()


def loss(loss_mask, output):
    mask = loss_mask.view(-1).float()
    total = torch.sum(output.float().view(-1) * mask)
    tokens = mask.sum().to(torch.int)
    return total, tokens, {"lm loss": torch.stack([total.detach(), tokens.float()])}


def step(data_iterator, model):
    batch = {k: v.cuda() for k, v in next(data_iterator).items() if isinstance(v, torch.Tensor)}
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    return output, partial(loss, batch["loss_mask"])


def greeting_flag(parser):
    parser.add_argument_group("own entry").add_argument("--greeting", default="hello")
    return parser


if __name__ == "__main__":
    print(f"own entry before pretrain: argv={sys.argv[1:]} dmi_modules={dmi_modules()}", flush=True)
    pretrain(build_datasets, build_model, ModelType.encoder_or_decoder, step, extra_args_provider=greeting_flag)
    print(
        f"own entry after pretrain: greeting={get_args().greeting} "
        f"pretrain_replaced={hasattr(pretrain, '__wrapped__')} dmi_modules={dmi_modules()}",
        flush=True,
    )
