"""DMI in a training loop of your own: plain megatron-core (no megatron.training), a tiny MoE GPT,
router and attention captured into embedded ClickHouse (chDB), then read back.

    python examples/custom_loop.py                      # from any directory; store under ./dmi_store
    torchrun --nproc-per-node 2 examples/custom_loop.py --expert-parallel 2   # on GPUs

With no GPU visible it trains on the CPU through DMI's CPU shim (megatron/core/dmi/cpu_mode.py).
Every call the loop makes to DMI is marked ``# DMI``: a session, ``attach``, ``before_forward``
before each microbatch's forward, ``flush`` + ``state`` at a checkpoint, ``close`` at the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import warnings

# Import-time notices of the libraries below, not of this loop: megatron-core says that Transformer Engine and
# Apex are missing (this example uses the local layer spec, which needs neither), torch's extension builder that
# no CUDA runtime is found (as expected on a CPU).
warnings.filterwarnings("ignore", message=r"(Transformer Engine and Apex are|Apex is) not installed")
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)

import torch  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.dmi import cpu_mode  # noqa: E402
from megatron.core.dmi.catalog import parse_hooks  # noqa: E402
from megatron.core.dmi.config import DMIConfig  # noqa: E402
from megatron.core.dmi.session import DMISession  # noqa: E402

VOCAB, SEQ, MICRO_BATCH = 128, 32, 2


def init_distributed(on_gpu: bool, expert_parallel: int) -> None:
    """One process per rank (torchrun's environment), or a world of one."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("nccl" if on_gpu else "gloo")
    ps.initialize_model_parallel(expert_model_parallel_size=expert_parallel)
    model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)


def tiny_moe(device: torch.device) -> GPTModel:
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        moe_ffn_hidden_size=128,  # set, not left to fall back to ffn_hidden_size with a warning
        num_attention_heads=4,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_token_dispatcher_type="allgather",
        add_bias_linear=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        deterministic_mode=True,
        cuda_graph_scope=[],  # upstream's default ("full") warns that it is deprecated; [] is the same whole layer
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
    )
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ).to(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--hooks", default="router,attn", help="what DMI captures (as --dmi-hooks)")
    p.add_argument(
        "--store",
        default=os.path.join(os.getcwd(), "dmi_store", "custom_loop"),
        help="DMI store directory (default: ./dmi_store/custom_loop)",
    )
    p.add_argument("--expert-parallel", type=int, default=1)
    args = p.parse_args()

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        cpu_mode.enable()  # megatron-core assumes CUDA in a few places; the shim answers them on a CPU
    init_distributed(on_gpu, args.expert_parallel)
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    model = tiny_moe(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    rank = torch.distributed.get_rank()

    session = DMISession(
        DMIConfig(hooks=parse_hooks(args.hooks), store_dir=args.store),  # DMI
        run_facts={"seq_length": SEQ, "vocab_size": VOCAB, "micro_batch_size": MICRO_BATCH},
    )
    session.attach(model)  # DMI
    if rank == 0:
        print(session.description)

    data = torch.Generator().manual_seed(1234 + ps.get_data_parallel_rank())
    positions = torch.arange(SEQ, device=device).unsqueeze(0).expand(MICRO_BATCH, -1)
    causal = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool, device=device), diagonal=1)  # True = masked
    for iteration in range(1, args.iterations + 1):  # 1-based, as Megatron logs iterations
        optimizer.zero_grad()
        total = 0.0
        for _ in range(args.microbatches):
            tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=data).to(device)
            session.before_forward(model, iteration)  # DMI: step context (phase from model.training)
            loss = model(tokens[:, :-1], positions, causal, labels=tokens[:, 1:]).float().mean() / args.microbatches
            loss.backward()
            total += loss.item()
        optimizer.step()
        if rank == 0:
            print(f"iteration {iteration} loss {total:.6f}")
            print(session.status_line())
        if iteration == args.iterations // 2:  # a checkpoint: DMI's records so far are durable
            session.flush()  # DMI
            if rank == 0:
                with open(os.path.join(args.store, f"checkpoint_state_iter_{iteration}.json"), "w") as f:
                    json.dump(session.state(iteration), f)  # DMI: resume with DMISession(resumed_run_id=...)

    report = session.close()  # DMI: collective; everything is in the store now
    if rank == 0:
        print(report.text)
        read_back(args.store, session.run_id, args.iterations)
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def read_back(store_dir: str, run_id: str, last_iteration: int) -> None:
    from megatron.core.dmi.reader import open_store

    with open_store(store_dir) as store:
        print(store.describe(run_id))
        print(store.expert_load(run_id).query("iteration == @last_iteration").to_string(index=False))
        ids = store.tensor(run_id, "router.topk_ids", iteration=last_iteration, microbatch=0, layer=1)
        print(
            f"router.topk_ids at iteration {last_iteration}, layer 1: shape {list(ids.shape)}, "
            f"first token's experts {ids[0].tolist()}"
        )


if __name__ == "__main__":
    main()
