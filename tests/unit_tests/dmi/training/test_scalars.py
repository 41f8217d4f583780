"""DMI's router scalars reach TensorBoard through Megatron's own writer: a real tiny-MoE run with
--tensorboard-dir, its event file read back with TensorBoard's reader and checked against an
independent in-run oracle of the router; the same values in W&B's history (offline mode); plus the
arithmetic of the summary on known totals."""

import glob
import json
import math
import os
import struct

import pytest
import torch

from megatron.training.dmi.scalars import normalised_entropy, summarise
from tests.functional_tests.launch import load_oracle, run_pretrain, tiny_moe_args

LAYERS, MICROBATCHES, ITERS, EXPERTS, TOPK = 2, 2, 4, 4, 2
TOKENS_PER_MICROBATCH = 2 * 32  # --micro-batch-size 2, --seq-length 32


def test_summary_of_known_totals():
    totals = torch.zeros(12, 2 * EXPERTS + 2, dtype=torch.float64)
    totals[3, :EXPERTS] = torch.tensor([6.0, 2, 0, 0])  # before capacity dropping
    totals[3, EXPERTS : 2 * EXPERTS] = torch.tensor([4.0, 2, 0, 0])  # after
    totals[3, 2 * EXPERTS :] = torch.tensor([1.5, 3])  # entropy sum over 3 tokens
    scalars, histograms = summarise(totals, EXPERTS, iterations=2)
    assert scalars == {
        "dmi/expert_load_imbalance/layer_03": 3.0,
        "dmi/drop_rate/layer_03": 0.25,
        "dmi/router_entropy/layer_03": 0.5,
        "dmi/expert_load_imbalance/worst_layer": 3.0,
        "dmi/drop_rate/all_layers": 0.25,
        "dmi/router_entropy/all_layers": 0.5,
    }
    assert list(histograms) == ["dmi/tokens_per_expert/layer_03"]
    assert histograms["dmi/tokens_per_expert/layer_03"].tolist() == [3.0, 1.0, 0.0, 0.0]


def test_normalised_entropy_spans_one_hot_to_uniform():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [50.0, -50.0, -50.0, -50.0]])
    for score_function in ("softmax", "sigmoid"):
        uniform, peaked = normalised_entropy(logits, score_function).tolist()
        assert uniform == pytest.approx(1.0)
        assert peaked == pytest.approx(0.0, abs=1e-6)


# One process; and two pipeline stages, where layer 0 lives on rank 0 and Megatron's writer on rank 1.
LAYOUTS = {"one-rank": (1, []), "pp2": (2, ["--pipeline-model-parallel-size", "2"])}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def run(request, tmp_path_factory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    nproc, layout = LAYOUTS[request.param]
    tmp = str(tmp_path_factory.mktemp("scalars"))
    run_pretrain(
        tiny_moe_args() + layout + ["--dmi-hooks", "router", "--dmi-persist", "none", "--tensorboard-dir", f"{tmp}/tb"],
        tmp,
        nproc=nproc,
    )
    events = EventAccumulator(f"{tmp}/tb", size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    oracle = {}
    for rank in range(nproc):
        oracle.update(load_oracle(tmp, rank))
    return events, oracle


def _expected(oracle, iteration: int, layer: int) -> tuple[torch.Tensor, float]:
    """Tokens per expert and mean normalised softmax entropy, from what the router really computed."""
    seen = [oracle[(iteration, m, layer)] for m in range(MICROBATCHES)]
    counts = sum(s["routing_map"].sum(0).double() for s in seen)
    probs = torch.cat([s["router.logits"].double().softmax(-1) for s in seen])
    entropy = (-(probs * probs.log()).sum(-1) / math.log(EXPERTS)).mean()
    return counts, float(entropy)


def test_every_layer_and_iteration_is_in_the_event_file(run):
    events, _ = run
    tags = set(events.Tags()["scalars"])
    for metric in ("expert_load_imbalance", "drop_rate", "router_entropy"):
        for layer in range(LAYERS):
            assert [e.step for e in events.Scalars(f"dmi/{metric}/layer_{layer:02d}")] == list(range(1, ITERS + 1))
    assert {
        "dmi/expert_load_imbalance/worst_layer",
        "dmi/drop_rate/all_layers",
        "dmi/router_entropy/all_layers",
    } <= tags
    assert "lm loss" in tags  # beside upstream's own scalars, in the same file


def test_values_match_the_router_oracle(run):
    events, oracle = run
    for layer in range(LAYERS):
        imbalance = {e.step: e.value for e in events.Scalars(f"dmi/expert_load_imbalance/layer_{layer:02d}")}
        drop_rate = {e.step: e.value for e in events.Scalars(f"dmi/drop_rate/layer_{layer:02d}")}
        entropy = {e.step: e.value for e in events.Scalars(f"dmi/router_entropy/layer_{layer:02d}")}
        histogram = {e.step: e.histogram_value for e in events.Histograms(f"dmi/tokens_per_expert/layer_{layer:02d}")}
        for iteration in range(1, ITERS + 1):
            counts, mean_entropy = _expected(oracle, iteration, layer)
            assert imbalance[iteration] == pytest.approx(float(counts.max() / counts.mean()), rel=1e-6)
            assert drop_rate[iteration] == 0.0  # no capacity factor: nothing dropped
            assert entropy[iteration] == pytest.approx(mean_entropy, rel=1e-5)
            h = histogram[iteration]
            assert (h.num, h.sum) == (EXPERTS, MICROBATCHES * TOKENS_PER_MICROBATCH * TOPK)
            assert (h.min, h.max) == (float(counts.min()), float(counts.max()))


def _wandb_records(path: str):
    """The records of an offline W&B run file: a LevelDB-style log (32 KiB blocks of chunks, each
    with a 7-byte header: CRC-32, length, type) after a 7-byte file header, each record a protobuf."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data.startswith(b":W&B"), path
    block, pos, chunks = 32 * 1024, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if (length, kind) == (0, 0):
            break
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def _wandb_history(run_dir: str) -> dict[int, dict[str, object]]:
    (path,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    history = {}
    for record in _wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[row["_step"]] = row
    return history


def test_the_same_scalars_reach_wandb_in_offline_mode(tmp_path, monkeypatch):
    """With --wandb-project (W&B offline, as a machine without network runs it), DMI's scalars and
    histograms land in the run's history through Megatron's W&B writer, at every log interval, with
    the values TensorBoard gets from the same run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp = str(tmp_path)
    wandb_args = ["--wandb-project", "dmi-test", "--wandb-exp-name", "tiny", "--wandb-save-dir", f"{tmp}/wb"]
    monkeypatch.setenv("WANDB_MODE", "offline")  # run_pretrain's child inherits it
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_pretrain(
        tiny_moe_args()
        + ["--dmi-hooks", "router", "--dmi-persist", "none", "--tensorboard-dir", f"{tmp}/tb"]
        + wandb_args,
        tmp,
        oracle=False,
    )
    history = _wandb_history(f"{tmp}/wb")
    events = EventAccumulator(f"{tmp}/tb", size_guidance={"scalars": 0})
    events.Reload()
    dmi_tags = [t for t in events.Tags()["scalars"] if t.startswith("dmi/")]
    assert len(dmi_tags) == 3 * LAYERS + 3
    assert set(history) >= set(range(1, ITERS + 1))
    for tag in dmi_tags:
        for event in events.Scalars(tag):
            assert history[event.step][tag] == pytest.approx(event.value, rel=1e-6), (tag, event.step)
    for step in range(1, ITERS + 1):
        for layer in range(LAYERS):
            assert history[step][f"dmi/tokens_per_expert/layer_{layer:02d}/_type"] == "histogram"
