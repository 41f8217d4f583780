"""examples/plot_dmi.py draws every plot from a small store."""

import os

import torch

from tests.unit_tests.dmi.isolated import run_isolated
from tests.unit_tests.dmi.sinks import workers as W


def test_plot_example(tmp_path):
    recs = W.moe_records(iterations=range(1, 4), layers=(0, 1), experts=4, seed=4)
    recs += [
        W.rec("attn.q", torch.randn(8, 1, 4, 8), iteration=3, layer=1),
        W.rec("attn.k", torch.randn(8, 1, 2, 8), iteration=3, layer=1),
    ]
    run_isolated(W.write_embedded, str(tmp_path / "s"), recs, [W.run_info()])
    written = run_isolated(W.run_plot_example, str(tmp_path / "s"), str(tmp_path / "png"))
    names = sorted(os.path.basename(p) for p in written)
    assert names == [
        "attention.png",
        "drop_rate.png",
        "expert_load.png",
        "expert_load_over_time.png",
        "hot_experts.png",
        "router_entropy.png",
        "topn_coverage.png",
    ]
    for p in written:
        assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def _plot_module():
    import importlib.util

    root = os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    )
    spec = importlib.util.spec_from_file_location("plot_dmi", os.path.join(root, "examples", "plot_dmi.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_layer_lines_integer_ticks_zero_axis_distinct_layers():
    import pandas as pd

    mod = _plot_module()
    layers = 24  # more than any colour cycle
    df = pd.DataFrame(
        [{"iteration": it, "layer": layer, "drop_rate": 0.0} for it in (1, 2, 3) for layer in range(layers)]
    )
    fig = mod.layer_lines_figure(df, "drop_rate", 100, "dropped (%)", "drops")
    ax = fig.axes[0]
    fig.canvas.draw()
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert ax.get_ylim() == (0.0, 1.0), "an all-zero series sits at the bottom of a 0..1 axis"
    styles = {(line.get_color(), line.get_linestyle(), line.get_marker()) for line in ax.get_lines()}
    assert len(styles) == layers, "every layer's line has its own colour/dash/marker"
    mod.plt.close(fig)
