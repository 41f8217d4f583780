"""Routing replay from a spool-only store (CPU, real pretrain_gpt.py processes): a run persisted with
--dmi-persist spool is replayed by a run that cannot import chDB, as on a GPU machine without it; the
extraction reads the source's verified segments directly (reader/spool.py)."""

import json
import os
import re
import shutil
import subprocess
import sys

import pyarrow.compute as pc
import pytest
import torch

from megatron.core.dmi.reader.routing_diff import read_expert_sets, routing_diff
from megatron.core.dmi.replay.extract import PROGRAM
from megatron.core.dmi.replay.request import ReplayRequest
from megatron.core.dmi.store.segments import list_segments, read_segment
from tests.functional_tests.launch import REPO, dump_store, run_pretrain, tiny_moe_args
from tests.functional_tests.runner import loss_strings
from tests.unit_tests.dmi.isolated import run_isolated

HOOKS = ["--dmi-hooks", "router.topk_ids,loss.token", "--dmi-persist", "spool"]
# examples/tiny_moe_args.sh's model, by the names of the stored model summary
TINY_FACTS = {
    "num_layers": 2,
    "num_moe_experts": 4,
    "moe_router_topk": 2,
    "seq_length": 32,
    "micro_batch_size": 2,
    "global_batch_size": 4,
}


@pytest.fixture(scope="module")
def no_chdb(tmp_path_factory) -> dict[str, str]:
    """An environment whose Pythons cannot import chDB (this machine has it; a GPU machine may not)."""
    site = tmp_path_factory.mktemp("no-chdb")
    (site / "sitecustomize.py").write_text("import sys\n\nsys.modules['chdb'] = None  # import chdb fails\n")
    return {"PYTHONPATH": os.pathsep.join([str(site), REPO, os.environ.get("PYTHONPATH", "")])}


def _train(tmp_path_factory, name: str, extra: list[str], env: dict | None = None) -> dict:
    tmp = str(tmp_path_factory.mktemp(name))
    store = os.path.join(tmp, "store")
    proc = run_pretrain(tiny_moe_args() + HOOKS + ["--dmi-store-dir", store] + extra, tmp, oracle=False, env=env)
    return {"store": store, "log": proc.stdout + proc.stderr}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return _train(tmp_path_factory, "source", [])


@pytest.fixture(scope="module")
def replay(tmp_path_factory, source, no_chdb):
    return _train(tmp_path_factory, "replay", ["--dmi-replay-routing", source["store"]], env=no_chdb)


def _outputs(store: str, tmp, output: str) -> dict:
    """``output``'s training tensors by (iteration, microbatch, layer), read through chDB (an independent reader)."""
    os.makedirs(tmp, exist_ok=True)
    dump = dump_store(store, str(tmp))
    return {k[1:4]: v for k, v in dump["tensors"].items() if k[4] == output and k[0] == "train"}


def _extract(store: str, tmp, env: dict | None = None) -> tuple[int, str, dict | None]:
    """The extraction subprocess as a training rank runs it: (status, last line of stderr, index)."""
    out = os.path.join(str(tmp), "routing.npy")
    request = ReplayRequest(store, None, [0, 1], 0, 1, 0, 1, False, 2, TINY_FACTS)
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM, out],
        input=request.to_json(),
        capture_output=True,
        text=True,
        cwd=REPO,
        env=dict(os.environ, **(env or {})),
    )
    lines = proc.stderr.strip().splitlines()
    index = os.path.join(str(tmp), "routing.json")
    return proc.returncode, lines[-1] if lines else "", json.load(open(index)) if proc.returncode == 0 else None


def _damaged_copy(source: dict, tmp, damage) -> tuple[str, str]:
    """A copy of the source store whose first tensor segment holding ``router.topk_ids`` ``damage(data, ids)``
    changed (``ids``: that segment's ``router.topk_ids`` rows); returns the store and the segment's name."""
    store = os.path.join(str(tmp), "store")
    shutil.copytree(source["store"], store)
    spool = os.path.join(store, "spool")
    for seg in list_segments(spool):
        table = read_segment(seg) if seg.kind == "tensors" else None
        ids = table.filter(pc.equal(table.column("output"), "router.topk_ids")) if table is not None else None
        if ids is not None and ids.num_rows:
            break
    with open(seg.path, "r+b") as f:
        data = damage(bytearray(f.read()), ids)
        f.seek(0)
        f.write(data)
    return store, os.path.relpath(seg.path, spool)


def test_a_spool_source_replays_bitwise_without_chdb(tmp_path, source, replay, no_chdb):
    """Same seed, routing replayed from the spool by a run that cannot import chDB: the same ids, bitwise losses."""
    assert not os.path.isdir(os.path.join(source["store"], "chdb"))  # nothing but the spool
    blocked = subprocess.run(
        [sys.executable, "-c", "import chdb"], capture_output=True, env=dict(os.environ, **no_chdb)
    )
    assert blocked.returncode != 0
    assert re.search(r"routing replayed from run \S+: 8 microbatches, .*fallbacks to live: 0", replay["log"])
    assert loss_strings(replay["log"]) == loss_strings(source["log"]) and len(loss_strings(source["log"])) == 4
    ids = _outputs(source["store"], tmp_path / "source", "router.topk_ids")
    replayed = _outputs(replay["store"], tmp_path / "replay", "router.topk_ids")
    assert len(ids) == 4 * 2 * 2 and replayed.keys() == ids.keys()
    assert all(torch.equal(replayed[k], ids[k]) for k in ids)


def test_the_spool_reader_reads_what_the_chdb_reader_reads(source, replay):
    """routing-diff's expert sets of a spool-only store, read without chDB, equal the chDB reader's."""
    run_id, sets = read_expert_sets(source["store"])
    chdb_run, chdb_sets = run_isolated(_chdb_expert_sets, source["store"])
    assert run_id == chdb_run and sets.keys() == chdb_sets.keys() and len(sets) == 16
    assert all((sets[k] == chdb_sets[k]).all() for k in sets)
    diff = routing_diff(sets, read_expert_sets(replay["store"])[1])
    assert diff["differing"].sum() == 0 and diff["tokens"].sum() == 4 * 2 * 2 * 64


def _chdb_expert_sets(store_dir: str):
    from megatron.core.dmi.reader.routing_diff import expert_sets
    from megatron.core.dmi.reader.store import open_store

    with open_store(store_dir) as store:
        run_id = store.resolve_run(None)
        return run_id, expert_sets(store, run_id)


def test_a_segment_that_does_not_verify_is_refused_in_one_line(tmp_path, source):
    def flip_header(data, _ids):
        data[40] ^= 1  # inside the raw segment's header
        return data

    store, segment = _damaged_copy(source, tmp_path, flip_header)
    status, err, _ = _extract(store, tmp_path)
    assert status == 2 and err.startswith("error: spool segment failed verification: ")
    assert f"{segment}: damaged raw segment header (CRC mismatch)" in err


def test_a_record_that_fails_its_crc_makes_its_iteration_unusable(tmp_path, source):
    """A flipped payload bit: that record is left out and its iteration named, for --dmi-replay-missing."""
    hit = {}

    def flip_payload(data, ids):
        hit["iteration"] = ids.column("iteration")[0].as_py()
        data[bytes(data).index(ids.column("payload")[0].as_py()) + 3] ^= 0x10
        return data

    store, segment = _damaged_copy(source, tmp_path, flip_payload)
    status, err, index = _extract(store, tmp_path)
    assert status == 0, err
    assert index["iterations"] == [it for it in (1, 2, 3, 4) if it != hit["iteration"]]
    assert index["unusable"] == {
        str(hit["iteration"]): f"a record in spool segment {segment} failed verification (payload CRC mismatch)"
    }


def test_a_chdb_store_without_chdb_is_refused_in_one_line(tmp_path, source, no_chdb):
    """A store with chdb/ holds ingested records only chDB reads: no silent fall back to its spool alone."""
    store = os.path.join(str(tmp_path), "store")
    shutil.copytree(source["store"], store)
    os.makedirs(os.path.join(store, "chdb"))
    status, err, _ = _extract(store, tmp_path, no_chdb)
    assert status == 2 and "needs the package 'chdb'" in err and "--dmi-persist spool" in err
