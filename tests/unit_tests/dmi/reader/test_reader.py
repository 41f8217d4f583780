"""Reader API against real embedded stores (each opened in its own process)."""

import math

import torch

from megatron.core.dmi.records import Record, tensor_to_payload
from tests.unit_tests.dmi.isolated import run_isolated
from tests.unit_tests.dmi.sinks import workers as W


def _iters(df):
    return sorted(set(int(x) for x in df["iteration"]))


def test_superseded_attempts_hidden(tmp_path):
    a1 = W.moe_records(iterations=range(1, 6), attempt=1, seed=0)
    a2 = W.moe_records(iterations=range(4, 7), attempt=2, seed=1)
    run_isolated(W.write_embedded, str(tmp_path), a1, [W.run_info(attempt=1)])
    run_isolated(W.write_embedded, str(tmp_path), a2, [W.run_info(attempt=2, resumed_from=3)])
    d = run_isolated(W.store_call, str(tmp_path), "describe", W.RUN)
    per_it = len(a1) // 5
    assert d.iterations == {"train": [1, 2, 3, 4, 5, 6]}
    assert d.records == 6 * per_it and d.superseded_records == 2 * per_it
    assert list(d.attempts["attempt"]) == [1, 2]
    # iteration 4 comes from attempt 2, iteration 3 from attempt 1
    q = [dict(run_id=W.RUN, output="router.logits", iteration=it, layer=0) for it in (3, 4)]
    t3, t4 = run_isolated(W.read_tensors, str(tmp_path), q)
    ref = {(r.key.attempt, r.key.iteration): r for r in a1 + a2 if r.key.layer == 0 and r.key.output == "router.logits"}

    def full(a, it):
        return torch.cat(
            [
                r.tensor()
                for r in a1 + a2
                if r.key.attempt == a and r.key.iteration == it and r.key.layer == 0 and r.key.output == "router.logits"
            ]
        )

    assert ref and torch.equal(t3, full(1, 3)) and torch.equal(t4, full(2, 4))
    load = run_isolated(W.store_call, str(tmp_path), "expert_load", W.RUN)
    assert _iters(load) == [1, 2, 3, 4, 5, 6]
    # a third attempt resumed from 5 and died before writing: attempt 2's iteration 6 is superseded too
    run_isolated(W.write_embedded, str(tmp_path), [], [W.run_info(attempt=3, resumed_from=5)])
    d = run_isolated(W.store_call, str(tmp_path), "describe", W.RUN)
    assert d.iterations == {"train": [1, 2, 3, 4, 5]}
    assert d.superseded_records == 3 * per_it


def test_expert_load_counts_replicas_once_and_sums_shards(tmp_path):
    sp = W.moe_records(run_id="sp", tp=2, sp=True, seed=3)  # token shards: sum
    rep = W.moe_records(run_id="rep", tp=2, sp=False, seed=3)  # replicated producers: once
    # a second data-parallel rank with its own tokens adds to the load
    dp1 = [
        Record(
            r.key.__class__(
                **{
                    **r.key.__dict__,
                    "coords": r.key.coords.__class__(rank=r.key.coords.rank + 2, tp=r.key.coords.tp, dp=1),
                }
            ),
            r.payload,
        )
        for r in rep
    ]
    run_isolated(W.write_embedded, str(tmp_path), sp + rep + dp1, [W.run_info(run_id="sp"), W.run_info(run_id="rep")])
    for run, recs, factor in (("sp", sp, 1), ("rep", rep, 2)):
        load = run_isolated(W.store_call, str(tmp_path), "expert_load", run)
        counts = [
            r for r in recs if r.key.output == "router.expert_counts" and r.key.iteration == 2 and r.key.layer == 1
        ]
        if run == "sp":
            expect = sum(r.tensor().long() for r in counts)
        else:
            expect = counts[0].tensor().long() * factor
        got = load[(load.iteration == 2) & (load.layer == 1)].sort_values("expert")
        assert list(got.tokens_pre) == expect[0].tolist()
        assert list(got.tokens_post) == expect[1].tolist()
        rate = run_isolated(W.store_call, str(tmp_path), "drop_rate", run)
        row = rate[rate.iteration == 2].iloc[0]
        assert math.isclose(row.drop_rate, (row.tokens_pre - row.tokens_post) / row.tokens_pre)
        assert row.drop_rate > 0


def test_router_entropy_matches_direct(tmp_path):
    recs = W.moe_records(tp=2, sp=True, seed=5)
    run_isolated(W.write_embedded, str(tmp_path), recs, [W.run_info()])
    ent = run_isolated(W.store_call, str(tmp_path), "router_entropy", W.RUN)
    assert len(ent) == 3 * 2
    for it in (1, 3):
        logits = torch.cat(
            [r.tensor() for r in recs if r.key.output == "router.logits" and r.key.iteration == it and r.key.layer == 0]
        )
        p = torch.softmax(logits, -1)
        h = float(torch.special.entr(p).sum(-1).mean())
        got = ent[(ent.iteration == it) & (ent.layer == 0)].iloc[0]
        assert math.isclose(got.entropy, h, rel_tol=1e-6)
        assert math.isclose(got.entropy_normalized, h / math.log(4), rel_tol=1e-6)


def test_attention_pattern_gqa_tp(tmp_path):
    s, b, heads, groups, d, tp = 6, 2, 4, 2, 8, 2
    g = torch.Generator().manual_seed(7)
    q = torch.randn(s, b, heads, d, generator=g).to(torch.bfloat16)
    k = torch.randn(s, b, groups, d, generator=g).to(torch.bfloat16)
    recs = []
    for t in range(tp):
        recs.append(
            W.rec("attn.q", q.chunk(tp, 2)[t].contiguous(), rank=t, tp=t, shard_index=t, shard_count=tp, layer=1)
        )
        recs.append(
            W.rec("attn.k", k.chunk(tp, 2)[t].contiguous(), rank=t, tp=t, shard_index=t, shard_count=tp, layer=1)
        )
    run_isolated(W.write_embedded, str(tmp_path), recs, [W.run_info()])
    for head in (0, 3):
        got = run_isolated(W.store_call, str(tmp_path), "attention_pattern", W.RUN, 1, 0, 1, head, batch=1)
        grp = head // (heads // groups)
        sc = q[:, 1, head].double() @ k[:, 1, grp].double().T / math.sqrt(d)
        sc = sc.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        ref = torch.softmax(sc, -1).float()
        assert got.shape == (s, s)
        assert torch.allclose(got, ref, atol=1e-6)
        assert torch.allclose(got.sum(-1), torch.ones(s))
        assert float(got.triu(1).abs().sum()) == 0.0


def test_gap_in_store_is_reported(tmp_path):
    full = torch.randn(4, 1, 8)
    recs = [
        W.rec("attn.context", p.contiguous(), rank=t, tp=t, shard_index=t, shard_count=4)
        for t, p in enumerate(full.chunk(4, -1))
    ]
    run_isolated(W.write_embedded, str(tmp_path), recs[:1] + recs[2:], [W.run_info(layers=[0])])
    (out,) = run_isolated(
        W.read_tensors, str(tmp_path), [dict(run_id=W.RUN, output="attn.context", iteration=1, layer=0)]
    )
    assert out[0] == "error" and out[1] == "ReconstructionError"
    assert "shard(s) [1] of 4 missing" in out[2]


def test_hostile_values_are_parameters(tmp_path):
    run_id = "x'); DROP TABLE dmi.tensors; --\\{run:String}"
    t = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    r = W.rec("router.logits", t.float(), run_id=run_id)
    run_isolated(W.write_embedded, str(tmp_path), [r], [W.run_info(run_id=run_id)])
    runs = run_isolated(W.store_call, str(tmp_path), "runs")
    assert list(runs.run_id) == [run_id]
    (got,) = run_isolated(
        W.read_tensors, str(tmp_path), [dict(run_id=run_id, output="router.logits", iteration=1, layer=0)]
    )
    assert torch.equal(got, t.float())
    assert tensor_to_payload(got) == r.payload


def _select_every_way(store_dir: str) -> dict:
    from megatron.core.dmi.errors import InvalidArgumentError
    from megatron.core.dmi.reader import TensorSelection, open_store

    sel = TensorSelection(W.RUN, "router.logits", 2, layer=1)
    with open_store(store_dir) as store:
        tensors = [
            store.tensor(W.RUN, "router.logits", 2, 0, 1, "train", 0, 0),
            store.tensor(run_id=W.RUN, output="router.logits", iteration=2, layer=1),
            store.tensor(sel),
            torch.from_numpy(store.array(sel)),
            torch.from_numpy(store.rebuild(W.RUN, "router.logits", 2, layer=1).values),
        ]
        shards = [r.key for r in store.records(sel)]
        try:
            store.rebuild(W.RUN, "router.logits", 2, layer=1, dp=None)
            refused = ""
        except InvalidArgumentError as e:
            refused = str(e)
    return {"tensors": tensors, "shards": shards, "refused": refused}


def test_the_tensor_methods_take_one_selection_however_it_is_given(tmp_path):
    recs = W.moe_records(iterations=range(1, 3), layers=(0, 1), tp=2, sp=True, seed=5)
    run_isolated(W.write_embedded, str(tmp_path), recs, [W.run_info()])
    got = run_isolated(_select_every_way, str(tmp_path))
    want = sorted(
        (r for r in recs if (r.key.output, r.key.iteration, r.key.layer) == ("router.logits", 2, 1)),
        key=lambda r: r.key.token_start,
    )
    full = torch.cat([r.tensor() for r in want])
    assert all(torch.equal(t, full) for t in got["tensors"])
    assert sorted(got["shards"], key=lambda k: k.token_start) == [r.key for r in want]
    assert "one data-parallel rank (dp), not None" in got["refused"]
