"""Check what an H200 brought back from the Transformer Engine cases (run_h200_te.sh), here where
chDB exists, and record their golden values:

    cat ft_h200_te.tgz.part_* | tar xz -C /tmp
    python -m tests.functional_tests.check_h200_te /tmp/ft_h200_te --json out.json [--record-golden]

For every case workdir in the archive (``<name>`` with DMI, ``<name>_off`` its DMI-off twin):

* loss: each step's lm loss as printed by the DMI run equals the DMI-off twin's (the log's digits);
* counts: the stored records per output equal ``layouts.expected_record_counts`` (analytic);
* oracle (cases run with it): every rebuilt tensor equals, bit for bit, what plain forward hooks
  copied in the same run; the stored top-k selects exactly megatron-core's routing map with its
  probabilities; the expert counts after drops equal the routing map's column sums;
* CUDA-graph cases: the stored tensors against the eager case of the same model (``EAGER_TWIN``):
  which are bitwise equal, and the largest difference of the others;
* replay cases: the run says that no router forward fell back to live routing, and its stored
  ``router.topk_ids`` hold the recording run's expert sets, token for token, both read from their
  spools without chDB (``reader/spool.py``, as the replaying run read its source on the GPU);
* analyses: routing concentration, routing predictability, loss against routing and gradient
  norms, read from the store of every case that captured their inputs (the three routing ones must
  answer on a CUDA-graph case that captured the router).

Prints one line per case and writes the findings (and the GPU's name) as JSON; exits 1 if a case
failed.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

import torch

from tests.functional_tests import runner
from tests.functional_tests.layouts import expected_record_counts
from tests.functional_tests.oracle_compare import bitwise, topk_consistent

# graph case -> the eager case whose stored tensors it is compared with
EAGER_TWIN = {"te_cuda_graph": "te_router_attn_bf16", "te_cuda_graph_dense_layer": "te_dense_bf16"}


def _case_dir(name: str) -> str | None:
    for case in runner.all_cases():
        if os.path.basename(case) == name:
            return case
    return None


def _platform(case: str) -> str:
    return "h200_te" if "h200_te" in (runner.load_case(case).get("PLATFORMS") or []) else "h200"


def _losses(workdir: str) -> dict[int, str]:
    with open(os.path.join(workdir, "train.log"), encoding="utf-8") as f:
        return runner.loss_strings(f.read())


def _oracle_findings(dump: dict, oracle: dict) -> dict:
    compared, mismatched = {}, []
    for (it, mb, layer), seen in oracle.items():
        key = ("train", it, mb, layer)
        for output, want in seen.items():
            got = dump["tensors"].get(key + (output, 0, 0))
            if got is None:
                continue  # not an output of this run
            compared[output] = compared.get(output, 0) + 1
            if not bitwise(got, want):
                mismatched.append(f"{output} it{it} mb{mb} layer{layer}")
        ids = dump["tensors"].get(key + ("router.topk_ids", 0, 0))
        if ids is not None and "routing_map" in seen:
            probs = dump["tensors"][key + ("router.topk_probs", 0, 0)]
            counts = dump["tensors"][key + ("router.expert_counts", 0, 0)]
            experts = seen["routing_map"].shape[1]
            for what, ok in (
                ("router.topk", topk_consistent(ids, probs, seen, experts=experts)),
                ("router.expert_counts", torch.equal(counts[1], seen["routing_map"].sum(0).to(torch.int32))),
            ):
                compared[what + " vs routing"] = compared.get(what + " vs routing", 0) + 1
                if not ok:
                    mismatched.append(f"{what} it{it} mb{mb} layer{layer}")
    return {"compared": compared, "mismatched": mismatched[:20], "mismatches": len(mismatched)}


def _analyses_findings(store_dir: str) -> dict:
    """What each analysis answers from the store: its row count, or why it could not answer."""
    from megatron.core.dmi.reader import analyses, open_store
    from megatron.core.dmi.reader.errors import StoreError

    store = open_store(store_dir, ingest=False)
    found = {}
    try:
        for name, run in (
            ("routing_concentration", lambda: analyses.routing_concentration(store).frequency),
            ("routing_predictability", lambda: analyses.routing_predictability(store)),
            ("loss_vs_routing", lambda: analyses.loss_vs_routing(store)),
            ("grad_norms", lambda: analyses.grad_norms(store).layers),
        ):
            try:
                found[name] = len(run())
            except StoreError as exc:
                found[name] = f"not answered: {exc}"
    finally:
        store.close()
    return found


def _replay_findings(work: str) -> dict:
    """The replaying run's expert sets against the recording run's (``source_store``), each read from its
    spool-only store by the chDB-free spool reader."""
    from megatron.core.dmi.reader.errors import StoreError
    from megatron.core.dmi.reader.routing_diff import read_expert_sets, routing_diff

    try:
        source_run, source = read_expert_sets(os.path.join(work, "source_store"))
        replay_run, replayed = read_expert_sets(os.path.join(work, "dmi_store"))
        diff = routing_diff(source, replayed)
    except StoreError as exc:
        return {"error": str(exc)}
    return {
        "source_run": source_run,
        "replay_run": replay_run,
        "same_tensors": sorted(source) == sorted(replayed),
        "tensors": len(replayed),
        "tokens": int(diff["tokens"].sum()),
        "differing": int(diff["differing"].sum()),
    }


def _twin_findings(dump: dict, eager: dict) -> dict:
    equal, differ, max_diff = 0, [], 0.0
    for key, t in dump["tensors"].items():
        ref = eager["tensors"].get(key)
        if ref is None:
            continue
        if bitwise(t, ref):
            equal += 1
            continue
        differ.append("/".join(map(str, key)))
        if t.is_floating_point() and t.shape == ref.shape:
            max_diff = max(max_diff, float((t.double() - ref.double()).abs().max()))
    return {"bitwise_equal": equal, "different": len(differ), "examples": differ[:10], "max_abs_diff": max_diff}


def check(root: str, name: str, record_golden: bool, dumps: dict) -> dict:
    case = _case_dir(name)
    work = os.path.join(root, name)
    found: dict = {"case": name}
    if case is None:
        return {**found, "ok": False, "problems": [f"no case directory named {name}"]}
    platform = _platform(case)
    problems = []
    died = []
    for log in glob.glob(os.path.join(work, "train*.log")):  # train.log, or a resumed case's two attempts
        with open(log, encoding="utf-8") as f:
            died += [line for line in f if re.match(r"\[rank0\]: [\w.]*(Error|Exception)\b", line)]
    if died:
        problems.append(f"training failed: {died[0].strip()[:300]}")
    result = runner.run_case(case, platform, workdir=work, compare_only=True)
    dumps[name] = result["dump"]
    if result["dump"]["errors"]:
        problems.append(f"reader errors: {result['dump']['errors'][:3]}")
    off = os.path.join(root, name + "_off")
    if os.path.isdir(off):
        with_dmi, without = _losses(work), _losses(off)
        found["loss_steps"] = len(with_dmi)
        found["loss_identical_to_dmi_off"] = with_dmi == without and bool(with_dmi)
        if not found["loss_identical_to_dmi_off"]:
            problems.append(f"lm loss with DMI {with_dmi} vs off {without}")
    if runner.load_case(case)["TEST_TYPE"] == "replay":  # trained under the recorded routing throughout
        said = r"routing replayed from run \S+: (\d+) microbatches, .*fallbacks to live: (\d+)"
        replayed = [(int(m), int(f)) for m, f in re.findall(said, "\n".join(result["logs"]))]
        found["replay_microbatches_fallbacks"] = replayed
        if not replayed or any(f or not m for m, f in replayed):
            problems.append(f"routing replay fell back to live routing (or replayed nothing): {replayed}")
        found["replay_routing"] = _replay_findings(work)
        same = found["replay_routing"]
        if "error" in same or not same["same_tensors"] or not same["tensors"] or same["differing"]:
            problems.append(f"the replaying run's expert sets differ from the recording run's: {same}")
    args = runner.model_args(runner.load_case(case), platform, {"DMI_STORE": "-"})
    counts = {k: n for k, n in result["summary"]["dmi_record_counts"].items() if k.startswith("train/")}
    found["record_counts"] = counts  # the analytic count covers training steps; evaluation is in the goldens
    expected = {f"train/{o}": n for o, n in expected_record_counts(args, 1).items()}
    found["expected_counts"] = expected
    if counts != expected:
        problems.append(f"record counts {counts} vs analytic {expected}")
    oracle_file = os.path.join(work, "oracle", "oracle-rank0.pt")
    if os.path.exists(oracle_file):
        found["oracle"] = _oracle_findings(result["dump"], torch.load(oracle_file, weights_only=False))
        if found["oracle"]["mismatches"] or not found["oracle"]["compared"]:
            problems.append(f"oracle: {found['oracle']}")
    found["analyses"] = _analyses_findings(os.path.join(work, "loaded_store"))
    routed = "router" in str(runner.load_case(case)["MODEL_ARGS"].get("--dmi-hooks", ""))
    routing = {k: n for k, n in found["analyses"].items() if k != "grad_norms"}  # graphs refuse grad
    if name in EAGER_TWIN and routed and not all(isinstance(n, int) and n > 0 for n in routing.values()):
        problems.append(f"analyses on the CUDA-graph store: {found['analyses']}")
    twin = EAGER_TWIN.get(name)
    if twin and twin in dumps:
        found["vs_eager_" + twin] = _twin_findings(result["dump"], dumps[twin])
    if record_golden and not problems:
        path = runner.golden_path(case, platform)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result["summary"], f, indent=1, sort_keys=True)
            f.write("\n")
        found["golden"] = os.path.relpath(path, runner.REPO)
    return {**found, "ok": not problems, "problems": problems}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", help="the unpacked ft_h200_te folder")
    p.add_argument("--json", default=None, help="write the findings here")
    p.add_argument(
        "--record-golden", action="store_true", help="write golden_values_dev_<platform>.json of cases that pass"
    )
    a = p.parse_args(argv)
    names = sorted(
        d for d in os.listdir(a.root) if os.path.isdir(os.path.join(a.root, d, "dmi_store")) and not d.endswith("_off")
    )
    names.sort(key=lambda n: n in EAGER_TWIN)  # eager references first
    findings, dumps = [], {}
    for name in names:
        try:
            f = check(a.root, name, a.record_golden, dumps)
        except runner.CaseFailure as exc:
            f = {"case": name, "ok": False, "problems": [str(exc)[-2000:]]}
        findings.append(f)
        print(f"{'PASSED' if f['ok'] else 'FAILED'} {name}" + "".join(f"\n  {p}" for p in f["problems"]))
    if a.json:
        gpu_txt = os.path.join(a.root, "gpu.txt")  # which card ran them (name, driver, memory)
        gpu = open(gpu_txt, encoding="utf-8").read().strip() if os.path.exists(gpu_txt) else None
        with open(a.json, "w", encoding="utf-8") as out:
            json.dump({"gpu": gpu, "cases": findings}, out, indent=1, sort_keys=True)
            out.write("\n")
    return 0 if all(f["ok"] for f in findings) else 1


if __name__ == "__main__":
    sys.exit(main())
