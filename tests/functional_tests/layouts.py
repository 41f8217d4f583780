"""Parallel layouts for the distributed-fidelity tests, and the analytic record count of a config.

Every layout trains the same tiny MoE (tests/functional_tests/test_cases' base model, weights from
``--use-cpu-initialization``, same seed, same data) on CPU processes over gloo.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.dmi import catalog

BASE_ARGS = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--ffn-hidden-size",
    "128",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--train-iters",
    "2",
    "--lr",
    "1e-3",
    "--seed",
    "1234",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "128",
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--disable-bias-linear",
    "--transformer-impl",
    "local",
    "--no-rope-fusion",
    "--no-masked-softmax-fusion",
    "--no-persist-layer-norm",
    "--no-gradient-accumulation-fusion",
    "--deterministic-mode",
    "--use-cpu-initialization",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
    "--eval-interval",
    "1000",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--dmi-hooks",
    "router,attn,attn.out,resid,mlp,loss,logits,grad",
]


@dataclass(frozen=True)
class Layout:
    name: str
    nproc: int
    args: tuple[str, ...]
    dispatcher: str = "allgather"
    doc: str = ""
    dense: bool = False  # no MoE: attention hooks only

    @property
    def experts(self) -> bool:
        """Whether the layout also captures mlp.experts (an MoE model without token dropping)."""
        return not self.dense and "--moe-expert-capacity-factor" not in self.args

    def full_args(self) -> list[str]:
        if not self.dense:
            hooks = ["--dmi-hooks", BASE_ARGS[-1] + ",mlp.experts"] if self.experts else []
            return BASE_ARGS + ["--moe-token-dispatcher-type", self.dispatcher] + hooks + list(self.args)
        args, skip = [], 0
        for _i, a in enumerate(BASE_ARGS):
            if skip:
                skip -= 1
                continue
            if a in ("--num-experts", "--moe-router-topk", "--dmi-hooks"):
                skip = 1
                continue
            args.append(a)
        return args + ["--dmi-hooks", "attn,attn.out,resid,mlp,loss,logits,grad"] + list(self.args)

    def value(self, flag: str, default: str | None = None) -> str | None:
        args = self.full_args()
        idx = [i for i, a in enumerate(args) if a == flag]
        return args[idx[-1] + 1] if idx else default

    def has(self, flag: str) -> bool:
        return flag in self.full_args()


# TP=2 with SP and EP=2 (ETP=1) on 4 processes, with either dispatcher
_TP2_SP_EP2 = (
    "--tensor-model-parallel-size",
    "2",
    "--sequence-parallel",
    "--expert-model-parallel-size",
    "2",
    "--expert-tensor-parallel-size",
    "1",
)
LAYOUTS = [
    # megatron-core 0.17.1 refuses to train MoE with TP > 1 and no sequence parallelism (moe_layer.py
    # raises ValueError), so TP without SP is a dense model (attention hooks only).
    Layout("tp2", 2, ("--tensor-model-parallel-size", "2"), dense=True),
    # Without TE/Apex the local spec's torch LayerNorm refuses SP in megatron-core 0.17.1; the CPU
    # shim marks its parameters for the TP gradient all-reduce instead (cpu_mode.py).
    Layout("tp2_sp", 2, ("--tensor-model-parallel-size", "2", "--sequence-parallel")),
    Layout("ep2_alltoall", 2, ("--expert-model-parallel-size", "2"), dispatcher="alltoall"),
    Layout("ep2_allgather", 2, ("--expert-model-parallel-size", "2")),
    Layout(
        "ep2_etp2",
        4,
        ("--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2", "--global-batch-size", "8"),
    ),  # alltoall + ETP gathers uneven tensors: NCCL only, not gloo
    Layout("tp2_sp_ep2", 4, _TP2_SP_EP2, dispatcher="alltoall"),
    # mlp.experts: one expert group holds the tokens of both TP shards and both EP ranks
    Layout("tp2_sp_ep2_allgather", 4, _TP2_SP_EP2),
    Layout("pp2", 2, ("--pipeline-model-parallel-size", "2")),
    Layout(
        "pp2_vpp2",
        2,
        ("--num-layers", "4", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"),
    ),
    Layout("dp2", 2, ()),
    Layout(
        "tp2_sp_shared",
        2,
        ("--tensor-model-parallel-size", "2", "--sequence-parallel", "--moe-shared-expert-intermediate-size", "64"),
    ),
    Layout(
        "ep2_capacity",
        2,
        ("--expert-model-parallel-size", "2", "--moe-expert-capacity-factor", "1.0"),
        dispatcher="alltoall",
    ),
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
    return [
        i for i in range(1, train_iters + 1) if i >= start and (end is None or i <= end) and (i - start) % interval == 0
    ]


def expected_record_counts(args: list[str], world_size: int) -> dict[str, int]:
    """Records a run stores per hook output, from its arguments and the catalog alone:

        captured iterations x microbatches x layers in the output's scope x producing ranks

    * layers: the selected layers (``--dmi-layers``) in the output's catalog scope (every layer,
      the MoE layers, those with a shared expert, or the last layer);
    * microbatches: per DP replica, or 1 for once-per-iteration outputs (``router.weight``);
    * producing ranks (``catalog.producers_per_replica``): per data-parallel replica
      (DP = world / (TP x PP x CP); EP and ETP subdivide the expert part of that replica set and do
      not add producers), the TP ranks for head-sharded outputs (attention) and for token outputs
      under sequence parallelism, else TP rank 0 only, summed over the DP replicas; a replicated
      weight comes from DP replica 0 only.

    Only the train phase is counted (the layouts do not evaluate; gradients are recorded in training
    steps only, one per forward value like the forward outputs).
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
    iters = captured_iterations(
        int(val("--train-iters")),
        int(val("--dmi-interval", 1)),
        int(val("--dmi-start-iter", 1)),
        int(val("--dmi-end-iter")) if val("--dmi-end-iter") else None,
    )
    num_layers = int(val("--num-layers"))
    layers = parse_layers(val("--dmi-layers"), num_layers)
    moe_layers = set(range(num_layers)) if val("--num-experts") else set()  # --moe-layer-freq 1
    shared_expert_layers = moe_layers if val("--moe-shared-expert-intermediate-size") else set()
    out = {}
    for output in sorted(catalog.parse_hooks(val("--dmi-hooks"))):
        producers = sum(catalog.producers_per_replica(output, tp, sp, dp_rank0=(r == 0)) for r in range(dp))
        per_step = micro if catalog.BY_NAME[output].per_microbatch else 1
        scoped = catalog.layers_in_scope(output, layers, num_layers, moe_layers, shared_expert_layers)
        if scoped:
            out[output] = len(iters) * per_step * len(scoped) * producers
    return out
