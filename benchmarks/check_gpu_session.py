"""Check what benchmarks/gpu_session.sh brought back from the GPU (run here, where chDB is):
load every run's spool into a chDB store, count records per output, compare the stored tensors of
the DMI run with those of the same run under selective recompute (bitwise), and compare the loss
curves of DMI-on runs with their DMI-off twins.

    python benchmarks/check_gpu_session.py <unpacked spools.tgz + train_logs.tgz dir> <out.json>
"""

import collections
import json
import os
import subprocess
import sys
import tempfile

import torch
from results_json import write_json  # benchmarks/ is the script directory

HERE = os.path.dirname(os.path.abspath(__file__))
DUMP = os.path.join(os.path.dirname(HERE), "tests", "functional_tests", "store_dump.py")


def dump(store: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "dump.pt")
        subprocess.run([sys.executable, DUMP, store, out], check=True, capture_output=True)
        return torch.load(out, weights_only=False)


def main(root: str, out: str) -> None:
    runs = sorted(d for d in os.listdir(root) if d.startswith("run_"))
    dumps = {r[len("run_") :]: dump(os.path.join(root, r, "store")) for r in runs}
    result = {"records_per_output": {}, "loss_identical_to_dmi_off_twin": {}, "tensors_bitwise_equal": {}}
    for name, d in dumps.items():
        result["records_per_output"][name] = dict(collections.Counter(r["output"] for r in d["rows"]))
    a, b = dumps.get("dmi"), dumps.get("dmi_recompute")
    if a and b:
        same = a["tensors"].keys() == b["tensors"].keys() and all(
            torch.equal(
                a["tensors"][k].view(torch.uint8) if a["tensors"][k].numel() else a["tensors"][k],
                b["tensors"][k].view(torch.uint8) if b["tensors"][k].numel() else b["tensors"][k],
            )
            for k in a["tensors"]
        )
        result["tensors_bitwise_equal"]["dmi vs dmi_recompute"] = {"tensors": len(a["tensors"]), "equal": same}

    def loss(n):
        with open(os.path.join(root, f"loss_{n}.txt")) as f:
            return f.read()

    for on, off in (("dmi", "off"), ("dmi_recompute", "off"), ("dense_graph_dmi", "dense_graph_off")):
        if os.path.exists(os.path.join(root, f"loss_{on}.txt")):
            result["loss_identical_to_dmi_off_twin"][on] = loss(on) == loss(off) and bool(loss(off).strip())
    write_json(out, result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
