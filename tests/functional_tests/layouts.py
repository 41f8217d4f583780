"""Parallel layouts for the distributed-fidelity tests, and the analytic record count of a config.

Every layout trains the same tiny MoE (tests/functional_tests/test_cases' base model, weights from
``--use-cpu-initialization``, same seed, same data) on CPU processes over gloo.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.dmi.catalog import GROUPS

BASE_ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--train-iters", "2", "--lr", "1e-3", "--seed", "1234", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "128", "--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear",
    "--transformer-impl", "local", "--no-rope-fusion", "--no-masked-softmax-fusion", "--no-persist-layer-norm",
    "--no-gradient-accumulation-fusion", "--deterministic-mode", "--use-cpu-initialization", "--log-interval", "1",
    "--eval-iters", "0", "--eval-interval", "1000", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--dmi-hooks", "router,attn",
]


@dataclass(frozen=True)
class Layout:
    name: str
    nproc: int
    args: tuple[str, ...]
    dispatcher: str = "allgather"
    doc: str = ""
    dense: bool = False  # no MoE: attention hooks only

    def full_args(self) -> list[str]:
        if not self.dense:
            return BASE_ARGS + ["--moe-token-dispatcher-type", self.dispatcher] + list(self.args)
        args, skip = [], 0
        for i, a in enumerate(BASE_ARGS):
            if skip:
                skip -= 1
                continue
            if a in ("--num-experts", "--moe-router-topk", "--dmi-hooks"):
                skip = 1
                continue
            args.append(a)
        return args + ["--dmi-hooks", "attn"] + list(self.args)

    def value(self, flag: str, default: str | None = None) -> str | None:
        args = self.full_args()
        idx = [i for i, a in enumerate(args) if a == flag]
        return args[idx[-1] + 1] if idx else default

    def has(self, flag: str) -> bool:
        return flag in self.full_args()


LAYOUTS = [
    # megatron-core 0.17.1 refuses to train MoE with TP > 1 and no sequence parallelism (moe_layer.py
    # raises ValueError), so TP without SP is a dense model (attention hooks only).
    Layout("tp2", 2, ("--tensor-model-parallel-size", "2"), dense=True),
    # Without TE/Apex the local spec's torch LayerNorm refuses SP in megatron-core 0.17.1; the CPU
    # shim marks its parameters for the TP gradient all-reduce instead (cpu_mode.py).
    Layout("tp2_sp", 2, ("--tensor-model-parallel-size", "2", "--sequence-parallel")),
    Layout("ep2_alltoall", 2, ("--expert-model-parallel-size", "2"), dispatcher="alltoall"),
    Layout("ep2_allgather", 2, ("--expert-model-parallel-size", "2")),
    Layout("ep2_etp2", 4, ("--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2",
                           "--global-batch-size", "8")),  # alltoall + ETP gathers uneven tensors: NCCL only, not gloo
    Layout("tp2_sp_ep2", 4, ("--tensor-model-parallel-size", "2", "--sequence-parallel",
                             "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"),
           dispatcher="alltoall"),
    Layout("pp2", 2, ("--pipeline-model-parallel-size", "2")),
    Layout("pp2_vpp2", 2, ("--num-layers", "4", "--pipeline-model-parallel-size", "2",
                           "--num-layers-per-virtual-pipeline-stage", "1")),
    Layout("dp2", 2, ()),
    Layout("ep2_capacity", 2, ("--expert-model-parallel-size", "2", "--moe-expert-capacity-factor", "1.0"),
           dispatcher="alltoall"),
]
BY_NAME = {l.name: l for l in LAYOUTS}


def parse_layers(spec: str | None, num_layers: int) -> list[int]:
    if spec is None:
        return list(range(num_layers))
    out = set()
    for item in spec.split(","):
        lo, _, hi = item.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return sorted(x for x in out if x < num_layers)


def captured_iterations(train_iters: int, interval: int = 1, start: int = 1, end: int | None = None) -> list[int]:
    return [i for i in range(1, train_iters + 1)
            if i >= start and (end is None or i <= end) and (i - start) % interval == 0]


def expected_record_counts(args: list[str], world_size: int) -> dict[str, int]:
    """Records a run stores per hook output, from its arguments alone:

        captured iterations x microbatches per DP replica x selected layers x producing ranks

    where the producing ranks of one (iteration, microbatch, layer) are, per data-parallel replica
    (DP = world / (TP x PP x CP); EP and ETP subdivide the expert part of that replica set and do
    not add producers of router or attention outputs):

    * router outputs: TP ranks with sequence parallelism (each routes its own sequence shard);
      without it only TP rank 0 publishes (every TP rank routed the same tokens), so 1;
    * attention outputs: TP ranks (each holds heads / TP heads).

    Only the train phase is counted (the layouts do not evaluate).
    """
    def val(flag, default=None):
        idx = [i for i, a in enumerate(args) if a == flag]
        return args[idx[-1] + 1] if idx else default

    tp = int(val("--tensor-model-parallel-size", 1))
    pp = int(val("--pipeline-model-parallel-size", 1))
    cp = int(val("--context-parallel-size", 1))
    sp = "--sequence-parallel" in args and tp > 1
    dp = world_size // (tp * pp * cp)
    micro = int(val("--global-batch-size")) // (int(val("--micro-batch-size")) * dp)
    iters = captured_iterations(int(val("--train-iters")), int(val("--dmi-interval", 1)), int(val("--dmi-start-iter", 1)),
                                int(val("--dmi-end-iter")) if val("--dmi-end-iter") else None)
    layers = parse_layers(val("--dmi-layers"), int(val("--num-layers")))
    hooks = set()
    for item in val("--dmi-hooks").split(","):
        hooks.update(GROUPS.get(item, (item,)))
    out = {}
    for output in sorted(hooks):
        producers = (tp if sp else 1) if output.startswith("router.") else tp
        out[output] = len(iters) * micro * len(layers) * producers * dp
    return out
