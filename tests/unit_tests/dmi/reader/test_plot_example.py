"""examples/plot_dmi.py draws every plot from a small store."""

import os

import torch

from megatron.core.dmi.sinks.isolated import run_isolated
from tests.unit_tests.dmi.sinks import workers as W


def test_plot_example(tmp_path):
    recs = W.moe_records(iterations=range(1, 4), layers=(0, 1), experts=4, seed=4)
    recs += [W.rec("attn.q", torch.randn(8, 1, 4, 8), iteration=3, layer=1),
             W.rec("attn.k", torch.randn(8, 1, 2, 8), iteration=3, layer=1)]
    run_isolated(W.write_embedded, str(tmp_path / "s"), recs, [W.run_info()])
    written = run_isolated(W.run_plot_example, str(tmp_path / "s"), str(tmp_path / "png"))
    names = sorted(os.path.basename(p) for p in written)
    assert names == ["attention.png", "drop_rate.png", "expert_load.png", "expert_load_over_time.png", "hot_experts.png",
                     "router_entropy.png", "topn_coverage.png"]
    for p in written:
        assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
