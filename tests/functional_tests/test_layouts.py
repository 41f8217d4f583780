"""Distributed fidelity: for each parallel layout, several real processes (torch.distributed.run,
gloo, CPU development mode) train the same tiny MoE with --dmi-hooks router,attn,resid,mlp,loss,logits,grad
and --dmi-persist spool; the spool is loaded into a store in another process and

* the stored record count equals the analytic count (layouts.expected_record_counts);
* every full tensor the reader rebuilds equals, bitwise, the oracle taken inside the same run
  (plain forward and backward hooks copying synchronously, all-gathered over the TP group inside the hook);
* at iteration 1, where the layout does not change numerics, it equals bitwise the same tensor of
  a single-rank run (SINGLE_RANK_BITWISE says which outputs, and why the others cannot);
* a store missing one rank's spool is refused by the reader, naming what is missing.
"""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch

from megatron.core.dmi import catalog
from tests.functional_tests import runner
from tests.functional_tests.layouts import BY_NAME, LAYOUTS, Layout, expected_record_counts
from tests.functional_tests.oracle_compare import bitwise, topk_consistent

ROUTER = ("router.logits", "router.topk_ids", "router.topk_probs", "router.expert_counts")
ALL = ROUTER + ("attn.context",)
# compared wherever the oracle saw them: resid.out only at the last layer, router.weight only at
# microbatch 0 of MoE layers (and stored by DP rank 0 only)
RESID_MLP = ("resid.in", "resid.out", "attn.out", "mlp.out", "mlp.shared", "router.weight", "loss.token")
LOGITS = ("logits.topk", "logits.target")  # merged from vocabulary shards: compared with plain torch
GRAD = ("grad.router_logits", "grad.attn_context", "grad.resid_in")  # from plain backward hooks

# Outputs whose iteration-1 tensors equal a single-rank run bitwise, per layout. Why not the rest:
# - TP: the attention output projection is row-parallel: each rank multiplies its heads' part and
#   the partial products are summed by an all-reduce, a different summation order than one GEMM,
#   so everything downstream of layer 0's attention (layer 0's router, layer 1) differs in the last
#   bits; the column-parallel QKV GEMM on half the heads is not guaranteed to match the full GEMM's
#   columns either. These compare with the in-run oracle.
# - EP (and EP with ETP or TP): --use-cpu-initialization draws every weight from the CPU generator in
#   construction order; a rank that builds only its own experts consumes fewer draws, so layer 1's
#   weights differ from the single-rank model; only layer 0 up to its router matches.
# - PP: each pipeline stage seeds its generator with seed + 100 * pp_rank, so stage 1's weights
#   differ from the single-rank model's layers there; stage 0's layers match.
SINGLE_RANK_BITWISE: dict[str, set[tuple[str, int]]] = {}  # filled from the table below
# EP: layer 0's input and router weight match; its MLP output holds the differently drawn experts.
_EXACT_LAYER0 = {(o, 0) for o in ALL} | {("resid.in", 0), ("router.weight", 0)}
_LAST_LAYER_ONLY = ("resid.out", "loss.token") + LOGITS
_ALL2 = {
    (o, l) for o in ALL + RESID_MLP + ("mlp.experts",) for l in (0, 1) if o not in _LAST_LAYER_ONLY + ("mlp.shared",)
} | {(o, 1) for o in _LAST_LAYER_ONLY}
SINGLE_RANK_EXPECT = {
    "dp2": _ALL2,
    "pp2": _EXACT_LAYER0 | {("mlp.out", 0), ("mlp.experts", 0)},
    "ep2_alltoall": _EXACT_LAYER0,
    "ep2_allgather": _EXACT_LAYER0,
    "ep2_capacity": None,  # different capacity factor from the reference run: in-run oracle only
    "ep2_etp2": None,  # DP=4 with a global batch of 8: different data from the reference run
    "tp2": set(),
    "tp2_sp": set(),
    "tp2_sp_ep2": set(),
    "tp2_sp_ep2_allgather": set(),
    "tp2_sp_shared": None,  # a shared expert: no single-rank reference run of that model here
    "pp2_vpp2": None,  # 4 layers: no single-rank reference run of that model here
}

_cache: dict[str, dict] = {}


def _run(name: str, layout: Layout | None, tmp_path_factory) -> dict:
    if name in _cache:
        return _cache[name]
    work = str(tmp_path_factory.mktemp(name))
    store = os.path.join(work, "dmi_store")
    if layout is None:  # the single-rank reference
        args, nproc = BY_NAME["dp2"].full_args(), 1  # the same model and hooks on one process
    else:
        args, nproc = layout.full_args(), layout.nproc
    args = args + ["--dmi-persist", "spool", "--dmi-store-dir", store, "--cpu-dev-mode"]
    spool_copy = os.path.join(work, "spool_copy")
    rc, log = runner.launch(
        args, nproc, work, "train.log", {"OMP_NUM_THREADS": "1"}, oracle_dir=os.path.join(work, "oracle")
    )
    assert rc == 0, log[-6000:]
    shutil.copytree(os.path.join(store, "spool"), spool_copy)  # the dump below ingests (and removes) the spool
    dump = runner.dump_store(store, os.path.join(work, "dump.pt"))
    oracle = {}
    for path in glob.glob(os.path.join(work, "oracle", "oracle-rank*.pt")):
        rank = int(os.path.basename(path)[len("oracle-rank") : -3])
        oracle[rank] = torch.load(path, weights_only=False)
    _cache[name] = {
        "dump": dump,
        "oracle": oracle,
        "args": args,
        "nproc": nproc,
        "work": work,
        "log": log,
        "spool": spool_copy,
    }
    return _cache[name]


@pytest.mark.parametrize("name", [l.name for l in LAYOUTS])
def test_layout(name, tmp_path_factory):
    layout = BY_NAME[name]
    res = _run(name, layout, tmp_path_factory)
    dump = res["dump"]
    assert not dump["errors"], dump["errors"]

    # 1. record count = analytic count
    counts: dict[str, int] = {}
    for r in dump["rows"]:
        counts[r["output"]] = counts.get(r["output"], 0) + 1
    assert counts == expected_record_counts(res["args"], res["nproc"]), (counts, res["log"][-3000:])

    # topology: one row per rank, each with its coordinates and layers
    topo = {int(t["rank"]): t for t in dump["topology"]}
    assert sorted(topo) == list(range(layout.nproc))

    # 2. reconstructed tensors == in-run oracle (gathered over TP inside the run), bitwise
    compared, compared_resid = 0, {}
    for rank, entries in res["oracle"].items():
        t = topo[rank]
        if int(t["tp"]) != 0:
            continue  # its TP group's full tensor is already on TP rank 0
        dp = int(t["dp"])
        for (it, mb, layer), seen in entries.items():
            key = ("train", it, mb, layer)
            got = {o: dump["tensors"][key + (o, 0, dp)] for o in (("attn.context",) if layout.dense else ALL)}
            assert bitwise(got["attn.context"], seen["attn.context"]), (name, key, dp)
            compared += 1
            for output in RESID_MLP + GRAD:
                if output in seen and (output != "router.weight" or dp == 0):
                    assert bitwise(dump["tensors"][key + (output, 0, dp)], seen[output]), (name, key, dp, output)
                    compared_resid[output] = compared_resid.get(output, 0) + 1
            if "logits" in seen:  # the merged vocabulary shards vs plain torch on the gathered logits
                logits, labels = seen["logits"].float(), seen["labels"]
                top = torch.topk(logits, 8, dim=-1)
                merged = dump["tensors"][key + ("logits.topk", 0, dp)]
                assert bitwise(merged[..., 0], top.values) and torch.equal(merged[..., 1].long(), top.indices), key
                want = torch.log_softmax(logits.double(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
                torch.testing.assert_close(dump["tensors"][key + ("logits.target", 0, dp)], want, rtol=0, atol=1e-5)
                for output in ("logits.topk", "logits.target"):
                    compared_resid[output] = compared_resid.get(output, 0) + 1
            if layout.dense:
                continue
            assert bitwise(got["router.logits"], seen["router.logits"]), (name, key, dp)
            assert topk_consistent(got["router.topk_ids"], got["router.topk_probs"], seen), (name, key, dp)
            counts_after = seen["routing_map"].sum(0).to(torch.int32)
            assert torch.equal(got["router.expert_counts"][1], counts_after), (name, key, dp)
    tp = int(layout.value("--tensor-model-parallel-size", "1"))
    expected = expected_record_counts(res["args"], res["nproc"])
    assert compared == expected["attn.context"] // tp
    sp = layout.has("--sequence-parallel")
    assert compared_resid == {
        o: expected[o] // catalog.producers_per_replica(o, tp, sp)  # records per full tensor
        for o in RESID_MLP + LOGITS + GRAD
        if o in expected
    }, compared_resid

    if layout.experts:
        experts_checked = check_expert_rows(dump, int(layout.value("--moe-router-topk")))
        assert experts_checked == expected["mlp.experts"] // catalog.producers_per_replica("mlp.experts", tp, sp)

    if name == "ep2_capacity":
        ids = torch.cat([v for k, v in dump["tensors"].items() if k[4] == "router.topk_ids"])
        assert int((ids == 4).sum()) > 0, "capacity factor 1.0 dropped nothing"

    # 3. iteration 1 vs a single-rank run of the same model and data
    expect = SINGLE_RANK_EXPECT[name]
    if expect is None:
        return
    single = _run("single_rank", None, tmp_path_factory)["dump"]["tensors"]
    dp_size = res["nproc"] // (
        int(layout.value("--tensor-model-parallel-size", "1"))
        * int(layout.value("--pipeline-model-parallel-size", "1"))
    )
    equal = set()
    for (phase, it, mb, layer, output, inv, dp), t in dump["tensors"].items():
        if it != 1:
            continue
        ref = single[(phase, 1, mb * dp_size + dp, layer, output, inv, 0)]
        if bitwise(t, ref):
            equal.add((output, layer, mb, dp))

    def slots(output):  # the (microbatch, dp) records of one iteration (a weight: microbatch 0 of DP 0)
        if output == "router.weight":
            return [(0, 0)]
        return [(m, d) for m in range(2 // dp_size) for d in range(dp_size)]

    per_output = {(o, l) for (o, l, _, _) in equal if all((o, l, m, d) in equal for m, d in slots(o))}
    assert expect <= per_output, (
        f"{name}: expected bitwise equal to single-rank {sorted(expect - per_output)}; equal: {sorted(per_output)}"
    )


def check_expert_rows(dump: dict, topk: int) -> int:
    """Every data-parallel rank's mlp.experts rows, rebuilt from its whole expert group: each token
    has ``topk`` rows naming it and their slot as router.topk_ids does, and a token's rows add up to
    mlp.out (minus mlp.shared). Close, not bitwise: the dispatcher adds each rank's rows before the
    group's reduce-scatter, and expert-tensor-parallel partials in the group's order. Returns how
    many (iteration, microbatch, layer, dp) were checked."""
    checked = 0
    for key, rows in dump["tensors"].items():
        if key[4] != "mlp.experts":
            continue
        step = lambda o, key=key: (*key[:4], o, *key[5:])  # noqa: E731  (the same step's other outputs)
        ids = dump["tensors"][step("router.topk_ids")].long()
        mlp_out = dump["tensors"][step("mlp.out")].reshape(ids.shape[0], -1)
        hidden = mlp_out.shape[1]
        assert rows.shape == (ids.shape[0] * topk, hidden + 3), (key, rows.shape)
        expert, token, slot = rows[:, hidden:].long().unbind(1)
        assert torch.equal(torch.bincount(token, minlength=ids.shape[0]), torch.full((ids.shape[0],), topk)), key
        assert torch.equal(ids[token, slot], expert), key
        shared = dump["tensors"].get(step("mlp.shared"))
        want = mlp_out - (shared.reshape(mlp_out.shape) if shared is not None else 0)
        summed = torch.zeros_like(mlp_out).index_add_(0, token, rows[:, :hidden])
        torch.testing.assert_close(summed, want, rtol=1e-5, atol=1e-6)
        checked += 1
    return checked


def without_rank_1(res: dict) -> dict:
    """A layout run's store dump with rank 1's spool left out."""
    work = res["work"]
    spool = os.path.join(work, "partial", "spool")
    shutil.copytree(res["spool"], spool)
    shutil.rmtree(os.path.join(spool, "rank-00001"))
    return runner.dump_store(os.path.join(work, "partial"), os.path.join(work, "partial.pt"))


def test_missing_rank_is_refused_and_named(tmp_path_factory):
    """Delete rank 1's spool of the TP=2 run, load the rest: the reader refuses attention tensors
    (rank 1 held half of the heads) and says which shard and rank are missing."""
    res = _run("tp2", BY_NAME["tp2"], tmp_path_factory)
    dump = without_rank_1(res)
    errors = {k: v for k, v in dump["errors"].items() if k[4] == "attn.context"}
    assert len(errors) == len([k for k in res["dump"]["tensors"] if k[4] == "attn.context"])
    msg = next(iter(errors.values()))
    assert "shard(s) [1] of 2 missing" in msg and "rank(s) 0" in msg, msg


def test_missing_expert_rank_is_refused(tmp_path_factory):
    """Delete rank 1's spool of the EP=2 allgather run: rank 0's own tokens had rows on rank 1's
    experts, so the reader refuses its mlp.experts instead of returning a token's rows in part."""
    res = _run("ep2_allgather", BY_NAME["ep2_allgather"], tmp_path_factory)
    dump = without_rank_1(res)
    errors = {k: v for k, v in dump["errors"].items() if k[4] == "mlp.experts"}
    assert errors and not any(k[4] == "mlp.experts" for k in dump["tensors"]), dump["errors"]
    msg = next(iter(errors.values()))
    assert "the records of a rank of the expert group are missing" in msg, msg
