"""Analyses on the store of a real tiny MoE run (pretrain_gpt.py on the CPU with
--dmi-hooks router,resid,loss,grad and capacity factor 1.0, so that routes are dropped), checked
against the same quantities computed with plain torch from the run's independent oracle (plain
forward and backward hooks on the routers and layers and pretrain_gpt's loss function,
tests/functional_tests/oracle_launch.py)."""

import os

import numpy as np
import pytest
import torch

from tests.functional_tests.launch import load_oracle, run_pretrain, tiny_moe_args
from tests.unit_tests.dmi.isolated import run_isolated
from tests.unit_tests.dmi.sinks import workers as W

ITERATIONS, EXPERTS, TOPK = 3, 4, 2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("analyses"))
    store = os.path.join(tmp, "store")
    run_pretrain(
        tiny_moe_args()
        + [
            "--train-iters",
            str(ITERATIONS),
            "--dmi-hooks",
            "router,resid,loss,grad",
            "--moe-expert-capacity-factor",
            "1.0",
            "--dmi-store-dir",
            store,
        ],
        tmp,
    )
    return store, load_oracle(tmp)


def concentration(store_dir: str, window: int):
    from megatron.core.dmi.reader import open_store
    from megatron.core.dmi.reader.analyses import routing_concentration

    with open_store(store_dir) as store:
        r = routing_concentration(store, window=window)
    return r.frequency, r.heatmap, r.coverage


def predictability(store_dir: str):
    from megatron.core.dmi.reader import open_store
    from megatron.core.dmi.reader.analyses import routing_predictability

    with open_store(store_dir) as store:
        return routing_predictability(store)


def _tokens_per_expert(oracle, layer, iterations):
    """The router's choices before capacity dropping: the top-k of its logits (softmax is monotonic)."""
    total = torch.zeros(EXPERTS, dtype=torch.long)
    for (it, _mb, l), v in oracle.items():
        if l == layer and it in iterations:
            chosen = torch.topk(v["router.logits"], TOPK, dim=-1).indices
            total += torch.bincount(chosen.reshape(-1), minlength=EXPERTS)
    return total


def _average_ranks(x):
    """Ranks 1..n, ties sharing their average rank (written out, independent of pandas)."""
    order = sorted(range(len(x)), key=lambda i: x[i])
    ranks = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return np.array(ranks)


def test_routing_concentration_matches_the_oracle(run):
    store, oracle = run
    frequency, heatmap, coverage = run_isolated(concentration, store, 2)
    for layer in (0, 1):
        want = _tokens_per_expert(oracle, layer, range(1, ITERATIONS + 1))
        got = frequency[frequency.layer == layer].sort_values("expert")
        assert got["tokens"].tolist() == want.tolist()
        assert got["share"].sum() == pytest.approx(1.0)
        shares = np.sort((want / want.sum()).numpy())[::-1]
        cov = coverage[coverage.layer == layer].sort_values("top_n")
        assert cov["top_n"].tolist() == [1, 2, 3, 4]
        assert cov["coverage"].to_numpy() == pytest.approx(np.cumsum(shares))
        # windows of 2 captured iterations: {1, 2} and {3}
        for start, end in ((1, 2), (3, 3)):
            d = heatmap[(heatmap.layer == layer) & (heatmap.window_start == start)].sort_values("expert")
            assert set(d["window_end"]) == {end}
            assert d["tokens"].tolist() == _tokens_per_expert(oracle, layer, range(start, end + 1)).tolist()


def test_routing_predictability_matches_plain_torch(run):
    store, oracle = run
    table = run_isolated(predictability, store)
    assert sorted(zip(table.iteration, table.layer)) == [(it, 1) for it in range(1, ITERATIONS + 1)]
    for _, row in table.iterrows():
        it = row["iteration"]
        weight = oracle[(it, 0, 1)]["router.weight"]
        predicted = torch.zeros(EXPERTS, dtype=torch.long)
        for (i, _mb, layer), v in oracle.items():
            if i == it and layer == 0:
                logits = v["resid.in"].reshape(-1, v["resid.in"].shape[-1]).float() @ weight.float().T
                for token in logits:
                    for e in sorted(range(EXPERTS), key=lambda e: (-float(token[e]), e))[:TOPK]:
                        predicted[e] += 1
        actual = _tokens_per_expert(oracle, 1, [it])
        assert row["predicted"] == predicted.tolist() and row["actual"] == actual.tolist()
        assert row["topk"] == TOPK and row["tokens"] == 32 * 2 * 2  # seq x micro batch x microbatches
        p, a = predicted.double().numpy(), actual.double().numpy()
        assert row["cosine"] == pytest.approx(p @ a / (np.linalg.norm(p) * np.linalg.norm(a)))
        if len(set(p)) > 1 and len(set(a)) > 1:
            assert row["spearman"] == pytest.approx(np.corrcoef(_average_ranks(p), _average_ranks(a))[0, 1])


def loss_table(store_dir: str):
    from megatron.core.dmi.reader import open_store
    from megatron.core.dmi.reader.analyses import loss_vs_routing

    with open_store(store_dir) as store:
        return loss_vs_routing(store)


def test_loss_vs_routing_matches_the_oracle(run):
    store, oracle = run
    table = run_isolated(loss_table, store)
    assert sorted(zip(table.iteration, table.layer)) == [
        (it, layer) for it in range(1, ITERATIONS + 1) for layer in (0, 1)
    ]
    assert table["tokens_dropped"].sum() > 0, "capacity factor 1.0 dropped no route"
    for _, row in table.iterrows():
        it, layer = row["iteration"], row["layer"]
        dropped, kept = [], []
        for (i, mb, l), v in sorted(oracle.items()):
            if i != it or l != layer:
                continue
            loss = oracle[(it, mb, 1)]["loss.token"]  # [s, b, 2], recorded under the last layer
            lost_a_route = v["routing_map"].sum(-1) < TOPK  # [s * b], the router's token order
            for token, (value, mask) in enumerate(loss.reshape(-1, 2).tolist()):
                if mask:
                    (dropped if lost_a_route[token] else kept).append(value)
        assert (row["tokens_dropped"], row["tokens_kept"]) == (len(dropped), len(kept))
        for column, values in (("loss_dropped", dropped), ("loss_kept", kept)):
            if values:
                assert row[column] == pytest.approx(sum(values) / len(values), rel=1e-12)


def grad_table(store_dir: str):
    from megatron.core.dmi.reader import open_store
    from megatron.core.dmi.reader.analyses import grad_norms

    with open_store(store_dir) as store:
        r = grad_norms(store)
    return r.layers, r.experts


def test_grad_norms_match_the_oracle(run):
    """Norms over every microbatch of an iteration, from the oracle's plain backward hooks."""
    store, oracle = run
    layers, experts = run_isolated(grad_table, store)
    gradients = ("grad.attn_context", "grad.resid_in", "grad.router_logits")
    assert sorted(zip(layers.iteration, layers.layer, layers.output)) == [
        (it, layer, o) for it in range(1, ITERATIONS + 1) for layer in (0, 1) for o in gradients
    ]
    for _, row in layers.iterrows():
        seen = [v[row["output"]].double() for (i, _mb, l), v in oracle.items() if (i, l) == (row.iteration, row.layer)]
        assert len(seen) == 2  # microbatches
        tokens = sum(g.numel() // g.shape[-1] for g in seen)
        squares = sum(float(g.square().sum()) for g in seen)
        assert row["tokens"] == tokens == 2 * 32 * 2  # microbatches x sequence x micro batch
        assert row["norm"] == pytest.approx(squares**0.5, rel=1e-12) and row["norm"] > 0
        assert row["rms_per_token"] == pytest.approx((squares / tokens) ** 0.5, rel=1e-12)
    assert sorted(set(zip(experts.iteration, experts.layer))) == [
        (it, layer) for it in range(1, ITERATIONS + 1) for layer in (0, 1)
    ]
    for (it, layer), d in experts.groupby(["iteration", "layer"]):
        columns = sum(
            v["grad.router_logits"].double().square().sum(dim=0)
            for (i, _mb, l), v in oracle.items()
            if (i, l) == (it, layer)
        )
        d = d.sort_values("expert")
        assert d["expert"].tolist() == list(range(EXPERTS))
        assert d["norm"].to_numpy() == pytest.approx(columns.sqrt().numpy(), rel=1e-12)
        assert d["share"].to_numpy() == pytest.approx((columns / columns.sum()).numpy(), rel=1e-12)


def test_cli_commands(run):
    store, _ = run
    rc, out = run_isolated(W.load_cli, ["routing-concentration", store, "--window", "2"])
    assert rc == 0, out
    assert "top-N coverage" in out and "hottest expert per layer, windows of 2" in out
    rc, out = run_isolated(W.load_cli, ["routing-predictability", store])
    assert rc == 0, out
    assert "cosine" in out and "spearman" in out and "per layer (mean over iterations)" in out
    rc, out = run_isolated(W.load_cli, ["loss-vs-routing", store])
    assert rc == 0, out
    assert "loss_dropped" in out and "loss_kept" in out
    rc, out = run_isolated(W.load_cli, ["grad-norms", store, "--layer", "1"])
    assert rc == 0, out
    assert "gradient RMS per token" in out and "grad.resid_in" in out and "router-logit gradient per expert" in out


@pytest.mark.parametrize("command", ["routing-predictability", "loss-vs-routing", "grad-norms"])
def test_analysis_commands_decode_without_torch(run, command):
    """The analyses that rebuild tensors decode them with numpy: the command's process never imports torch."""
    from tests.unit_tests.dmi.test_cli import imports_of_command

    store, _ = run
    out, _ = imports_of_command([command, store])
    assert out.rstrip().endswith("LOADED False False 0"), out


def test_routing_diff_of_a_run_with_itself_is_zero_without_torch(run, tmp_path):
    """routing-diff reads one run in its own process and the other in a subprocess (neither imports torch); a
    store that is not there is named in a one-line error, whichever side it is on."""
    from tests.unit_tests.dmi.test_cli import imports_of_command

    store, _ = run
    out, _ = imports_of_command(["routing-diff", store, store])
    assert f"overall: 0 of {ITERATIONS * 2 * 2 * 64} tokens (0.00%)" in out and out.rstrip().endswith(
        "LOADED False False 0"
    ), out
    missing = str(tmp_path / "nothere")
    for argv in (["routing-diff", missing, store], ["routing-diff", store, missing]):
        rc, err = run_isolated(W.cli_stderr, argv)
        assert rc == 2 and err.strip().startswith(f"error: {missing}: ") and len(err.strip().splitlines()) == 1, err


def test_predictability_and_grad_norms_name_what_to_capture(tmp_path):
    """A store without resid.in/router.weight or gradients gets a one-line error naming what to capture."""
    recs = W.moe_records(iterations=range(1, 3), layers=(0, 1), experts=4, seed=3)
    run_isolated(W.write_embedded, str(tmp_path / "s"), recs, [W.run_info()])
    rc, _ = run_isolated(W.load_cli, ["routing-predictability", str(tmp_path / "s")])
    assert rc == 2
    rc, err = run_isolated(W.cli_stderr, ["grad-norms", str(tmp_path / "s")])
    assert rc == 2 and "--dmi-hooks grad" in err


def test_plots(run, tmp_path):
    store, _ = run
    written = run_isolated(W.run_plot_example, store, str(tmp_path / "png"))
    names = sorted(os.path.basename(p) for p in written)
    assert {
        "hot_experts.png",
        "topn_coverage.png",
        "routing_predictability.png",
        "loss_vs_routing.png",
        "grad_norm_resid_in.png",
        "grad_norm_attn_context.png",
        "grad_norm_router_logits.png",
        "grad_norm_experts.png",
    } <= set(names)
    for p in written:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
