"""Functional-test runner (upstream style): launch pretrain_gpt.py with one test case, read the DMI
tables and the training log, and compare with the case's golden values.

    python -m tests.functional_tests.runner --case tests/functional_tests/test_cases/gpt_moe/tiny_router_attn
    python -m tests.functional_tests.runner --case <dir> --record-golden          # write the golden file
    python -m tests.functional_tests.runner --case <dir> --platform h200 --workdir W --launch-only
                                                             # on the GPU machine (no chDB): train, spool only
    python -m tests.functional_tests.runner --case <dir> --platform h200 --workdir W --compare-only
                                                             # later, where chDB exists: load W's spool

A case is ``test_cases/<model>/<case>/model_config.yaml``:

    ENV_VARS: {NAME: value}             # added to the launch environment
    NPROC: 1                            # processes (python for 1, torch.distributed.run for more)
    TEST_TYPE: regular | ckpt-resume | replay   # ckpt-resume: killed (SIGKILL) after KILL_AFTER_ITER, resumed with --load
    KILL_AFTER_ITER: 3                  # replay: a first run records into ${SOURCE_STORE} (MODEL_ARGS with
    SOURCE_ARGS: {--flag: value}        # SOURCE_ARGS, no --dmi-replay-routing), then the case's run replays it
    MODEL_ARGS: {--flag: value}         # value true: a bare flag, a list: several values;
                                        # ${CHECKPOINT_PATH}, ${DMI_STORE} substituted
    PLATFORM_ARGS: {cpu: {...}, h200: {...}, h200_te: {...}}   # extra flags per platform

and its golden values ``golden_values_<env>_<platform>.json``:

    {"lm loss": {"start_step": 1, "end_step": N, "step_interval": 1, "values": {"1": 5.5, ...}},
     "dmi_iterations": {"train": [1, 2, ...]},      # visible (phase, iteration)s
     "dmi_record_counts": {"train/router.logits": n, ...},   # visible stored records per phase/output
     "dmi_checksums": {"train/1/0/0/router.logits/0/0": crc32, ...}}  # phase/it/mb/layer/output/inv/dp

Counts, iterations and checksums (crc32 of each reconstructed full tensor) compare exactly, the
loss with rtol 0.05.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
CASES = os.path.join(HERE, "test_cases")
LOSS_RTOL = 0.05
_LOSS_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+\-naninf]+)")


# h200_te: the H200 with Transformer Engine installed (shared/te-h200), for the TE-spec cases
PLATFORMS = ("cpu", "h200", "h200_te")


class CaseFailure(AssertionError):
    pass


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_case(case_dir: str) -> dict:
    with open(os.path.join(case_dir, "model_config.yaml"), encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    cfg.setdefault("NPROC", 1)
    cfg.setdefault("TEST_TYPE", "regular")
    cfg.setdefault("ENV_VARS", {})
    if cfg["TEST_TYPE"] not in ("regular", "ckpt-resume", "replay"):
        raise ValueError(f"{case_dir}: unknown TEST_TYPE {cfg['TEST_TYPE']!r}")
    return cfg


def golden_path(case_dir: str, platform: str, env: str = "dev") -> str:
    return os.path.join(case_dir, f"golden_values_{env}_{platform}.json")


def model_args(cfg: dict, platform: str, subst: dict[str, str], dmi: bool = True) -> list[str]:
    """The case's command line on ``platform``; ``dmi=False``: the same training with every
    ``--dmi-*`` flag left out (the DMI-off twin a loss is compared with)."""
    flags = dict(cfg.get("MODEL_ARGS") or {})
    flags.update((cfg.get("PLATFORM_ARGS") or {}).get(platform) or {})
    out: list[str] = []
    for flag, value in flags.items():
        if value is False or value is None or (not dmi and flag.startswith("--dmi-")):
            continue
        out.append(flag)
        if isinstance(value, list):  # a flag that takes several values (nargs="+")
            out += [str(v) for v in value]
        elif value is not True:
            value = str(value)
            for k, v in subst.items():
                value = value.replace("${" + k + "}", v)
            out.append(value)
    if platform == "cpu":
        out.append("--cpu-dev-mode")
    elif dmi:  # no chDB on the GPU machines: spool, loaded later with `python -m megatron.core.dmi load`
        out += ["--dmi-persist", "spool"]
    return out


def launch(
    args: list[str],
    nproc: int,
    workdir: str,
    log_name: str,
    env_vars: dict | None = None,
    kill_after: int | None = None,
    oracle_dir: str | None = None,
    timeout: int = 600,
    torchrun: bool = False,
) -> tuple[int, str]:
    """Run pretrain_gpt.py (through the test launcher when a kill or an oracle is wanted). One CPU
    process runs bare (the CPU mode sets up its own rendezvous); otherwise torch.distributed.run."""
    test_launcher = kill_after is not None or oracle_dir is not None
    script = os.path.join(HERE, "oracle_launch.py") if test_launcher else os.path.join(REPO, "pretrain_gpt.py")
    if nproc == 1 and not torchrun:
        cmd = [sys.executable, script]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}",
            script,
        ]
    cmd += args
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update({k: str(v) for k, v in (env_vars or {}).items()})
    env.pop("DMI_ORACLE_OUT", None)
    env.pop("DMI_TEST_KILL_AFTER_ITER", None)
    if kill_after is not None:
        env["DMI_TEST_KILL_AFTER_ITER"] = str(kill_after)
    if oracle_dir is not None:
        env["DMI_ORACLE_OUT"] = oracle_dir
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
    log = f"$ {shlex.join(cmd)}\n{proc.stdout}{proc.stderr}\n# rc={proc.returncode} in {time.monotonic() - t0:.1f} s\n"
    with open(os.path.join(workdir, log_name), "w", encoding="utf-8") as f:
        f.write(log)
    return proc.returncode, log


def loss_strings(log: str) -> dict[int, str]:
    """Iteration -> the lm loss as the log printed it (compare these for bitwise equality)."""
    return {int(m.group(1)): m.group(2) for m in _LOSS_RE.finditer(log)}


def parse_losses(log: str) -> dict[int, float]:
    return {it: float(loss) for it, loss in loss_strings(log).items()}


def dump_store(store_dir: str, out: str, load: str | None = None, timeout: int = 600) -> dict:
    """The store read back in its own process (store_dump.py)."""
    import torch

    cmd = [sys.executable, os.path.join(HERE, "store_dump.py"), store_dir, out] + (["--load", load] if load else [])
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", "")),
    )
    if proc.returncode != 0:
        raise CaseFailure(f"reading the DMI store {store_dir} failed:\n{proc.stderr[-4000:]}")
    return torch.load(out, weights_only=False)


def summarize(dump: dict, losses: dict[int, float], stats: bool = True) -> dict:
    """The golden-value view of one run: loss per step, visible iterations, counts, checksums, and
    (``stats``) each tensor's statistics, which let a checksum differ within a tolerance."""
    from tests.functional_tests.store_dump import tensor_crc, tensor_stats

    counts: dict[str, int] = {}
    iterations: dict[str, set] = {}
    for r in dump["rows"]:
        if not r["visible"]:
            continue
        key = f"{r['phase']}/{r['output']}"
        counts[key] = counts.get(key, 0) + 1
        iterations.setdefault(r["phase"], set()).add(int(r["iteration"]))
    checksums = {"/".join(map(str, k)): tensor_crc(t) for k, t in sorted(dump["tensors"].items())}
    steps = sorted(losses)
    summary = {
        "lm loss": {
            "start_step": steps[0] if steps else 0,
            "end_step": steps[-1] if steps else 0,
            "step_interval": 1,
            "values": {str(s): losses[s] for s in steps},
        },
        "dmi_iterations": {p: sorted(v) for p, v in sorted(iterations.items())},
        "dmi_record_counts": dict(sorted(counts.items())),
        "dmi_checksums": checksums,
    }
    if stats:
        summary["dmi_stats"] = {"/".join(map(str, k)): tensor_stats(t) for k, t in sorted(dump["tensors"].items())}
    return summary


# Where a checksum differs, a tensor still matches a golden whose statistics it meets within
# STATS_RTOL of the golden RMS (plus STATS_ATOL): another processor generation sums in another order
# even with the pins below, and its last bits differ (seen: goldens of one Xeon generation on another).
STATS_RTOL, STATS_ATOL = 1e-3, 1e-6


def compare(actual: dict, golden: dict) -> list[str]:
    problems = []
    gl, al = golden["lm loss"]["values"], actual["lm loss"]["values"]
    if sorted(gl, key=int) != sorted(al, key=int):
        problems.append(f"lm loss steps differ: golden {sorted(gl, key=int)} vs actual {sorted(al, key=int)}")
    for step, g in gl.items():
        a = al.get(step)
        if a is not None and abs(a - g) > LOSS_RTOL * abs(g):
            problems.append(f"lm loss at step {step}: {a} vs golden {g} (rtol {LOSS_RTOL})")
    for field in ("dmi_iterations", "dmi_record_counts"):
        if actual[field] != golden[field]:
            problems.append(f"{field}: {actual[field]} vs golden {golden[field]}")
    ga, aa = golden["dmi_checksums"], actual["dmi_checksums"]
    if set(ga) != set(aa):
        problems.append(
            f"checksummed tensors differ: missing {sorted(set(ga) - set(aa))[:5]}, "
            f"unexpected {sorted(set(aa) - set(ga))[:5]}"
        )
    bad = [k for k in ga if k in aa and ga[k] != aa[k]]
    gs, as_ = golden.get("dmi_stats"), actual.get("dmi_stats", {})
    if bad and gs:  # not bitwise here: within tolerance of the golden's mean and RMS
        bad = [k for k in bad if not _stats_close(as_.get(k), gs.get(k))]
        if bad:
            problems.append(f"{len(bad)} tensor(s) differ beyond rtol {STATS_RTOL} of their statistics, e.g. {bad[:5]}")
    elif bad:
        problems.append(f"{len(bad)} checksum(s) differ, e.g. {bad[:5]}")
    return problems


def _stats_close(actual: list[float] | None, golden: list[float] | None) -> bool:
    if actual is None or golden is None:
        return False
    tol = STATS_RTOL * abs(golden[1]) + STATS_ATOL
    return all(abs(a - g) <= tol for a, g in zip(actual, golden))


# CPU goldens are bitwise, and torch's own kernels, MKL and oneDNN each pick the widest SIMD the
# processor has: an AVX-512 machine sums in another order than an AVX2 one. Pinned to AVX2, every
# x86-64 machine with AVX2 computes what the recording machine did.
CPU_ISA_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def run_case(
    case_dir: str,
    platform: str = "cpu",
    workdir: str | None = None,
    compare_only: bool = False,
    oracle: bool = False,
    launch_only: bool = False,
    dmi: bool = True,
) -> dict:
    """Run one case (or, with ``compare_only``, read a workdir a GPU run left) and return
    {"summary", "dump", "logs", "workdir"}. Raises CaseFailure if a run fails. ``launch_only``:
    train and stop (the store is read later with ``compare_only``); returns only the logs."""
    cfg = load_case(case_dir)
    workdir = workdir or tempfile.mkdtemp(prefix="dmi-ft-")
    os.makedirs(workdir, exist_ok=True)
    store = os.path.join(workdir, "dmi_store")
    subst = {
        "CHECKPOINT_PATH": os.path.join(workdir, "checkpoints"),
        "DMI_STORE": store,
        "TENSORBOARD_PATH": os.path.join(workdir, "tensorboard"),
        "SOURCE_STORE": os.path.join(workdir, "source_store"),
    }
    args = model_args(cfg, platform, subst, dmi=dmi)
    nproc = int(cfg["NPROC"])
    env_vars = {**(CPU_ISA_ENV if platform == "cpu" else {}), **cfg["ENV_VARS"]}
    logs: list[str] = []
    if not compare_only:
        shutil.rmtree(store, ignore_errors=True)
        oracle_dir = os.path.join(workdir, "oracle") if oracle else None
        if cfg["TEST_TYPE"] == "replay":
            source = {**cfg["MODEL_ARGS"], **cfg.get("SOURCE_ARGS", {}), "--dmi-store-dir": "${SOURCE_STORE}"}
            source.pop("--dmi-replay-routing")
            shutil.rmtree(subst["SOURCE_STORE"], ignore_errors=True)
            source_args = model_args({**cfg, "MODEL_ARGS": source}, platform, subst, dmi=dmi)
            rc, log = launch(source_args, nproc, workdir, "train_source.log", env_vars, torchrun=platform != "cpu")
            if rc != 0:
                raise CaseFailure(f"the recording run failed (rc {rc}):\n{log[-6000:]}")
        if cfg["TEST_TYPE"] == "ckpt-resume":
            kill = int(cfg.get("KILL_AFTER_ITER", 3))
            rc, log = launch(
                args, nproc, workdir, "train_attempt1.log", env_vars, kill_after=kill, torchrun=platform != "cpu"
            )
            logs.append(log)
            if rc == 0:
                raise CaseFailure(
                    f"attempt 1 was to be killed after iteration {kill} but exited cleanly:\n{log[-3000:]}"
                )
            if f"iteration {kill:8d}/" not in log:
                raise CaseFailure(f"attempt 1 died before iteration {kill}:\n{log[-5000:]}")
            rc, log = launch(
                args, nproc, workdir, "train_attempt2.log", env_vars, oracle_dir=oracle_dir, torchrun=platform != "cpu"
            )
        else:
            rc, log = launch(
                args, nproc, workdir, "train.log", env_vars, oracle_dir=oracle_dir, torchrun=platform != "cpu"
            )
        logs.append(log)
        if rc != 0:
            raise CaseFailure(f"pretrain_gpt.py failed (rc {rc}):\n{log[-6000:]}")
        if launch_only:
            return {"logs": logs, "workdir": workdir}
    else:
        for name in ("train_attempt1.log", "train_attempt2.log", "train.log"):
            path = os.path.join(workdir, name)
            if os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    logs.append(f.read())
    losses: dict[int, float] = {}
    for log in logs:  # a resumed attempt's steps replace the killed attempt's
        losses.update(parse_losses(log))
    if platform == "cpu":
        dump = dump_store(store, os.path.join(workdir, "dump.pt"))
    else:
        loaded = os.path.join(workdir, "loaded_store")
        os.makedirs(loaded, exist_ok=True)
        dump = dump_store(loaded, os.path.join(workdir, "dump.pt"), load=os.path.join(store, "spool"))
    # GPU goldens stay bitwise (deterministic mode; the H100 reproduced the H200's): no statistics
    summary = summarize(dump, losses, stats=platform == "cpu")
    return {"summary": summary, "dump": dump, "logs": logs, "workdir": workdir}


def check_case(case_dir: str, platform: str = "cpu", **kwargs) -> dict:
    """Run a case and compare with its golden values; raises CaseFailure listing every difference."""
    result = run_case(case_dir, platform, **kwargs)
    path = golden_path(case_dir, platform)
    if not os.path.exists(path):
        raise CaseFailure(f"no golden values at {path}; record them with --record-golden")
    with open(path, encoding="utf-8") as f:
        golden = json.load(f)
    problems = compare(result["summary"], golden)
    if problems:
        raise CaseFailure(
            f"{case_dir} ({platform}) differs from {os.path.basename(path)} (workdir {result['workdir']}):\n  "
            + "\n  ".join(problems)
        )
    return result


def record_golden(case_dir: str, platform: str = "cpu", **kwargs) -> str:
    result = run_case(case_dir, platform, **kwargs)
    path = golden_path(case_dir, platform)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result["summary"], f, indent=1, sort_keys=True)
        f.write("\n")
    return path


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def all_cases(root: str = CASES) -> list[str]:
    out = []
    for dirpath, _, files in os.walk(root):
        if "model_config.yaml" in files:
            out.append(dirpath)
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", action="append", help="case directory (repeatable; default: every case)")
    p.add_argument("--platform", default="cpu", choices=PLATFORMS)
    p.add_argument("--record-golden", action="store_true", help="write golden_values_dev_<platform>.json")
    p.add_argument("--workdir", default=None, help="keep logs, store and spool here (one case)")
    p.add_argument("--compare-only", action="store_true", help="do not launch: read --workdir's logs and spool")
    p.add_argument("--launch-only", action="store_true", help="train and keep --workdir, read nothing (GPU machine)")
    p.add_argument(
        "--oracle", action="store_true", help="with --launch-only: also keep the in-run oracle (oracle_launch.py)"
    )
    p.add_argument(
        "--no-dmi", action="store_true", help="with --launch-only: the same training without any --dmi-* flag"
    )
    a = p.parse_args(argv)
    if a.launch_only and (a.compare_only or a.record_golden):
        p.error("--launch-only cannot be combined with --compare-only or --record-golden")
    if (a.oracle or a.no_dmi) and not a.launch_only:
        p.error("--oracle and --no-dmi go with --launch-only")
    cases = a.case or [  # every case of the platform; named cases run as asked
        c for c in all_cases() if a.platform in (load_case(c).get("PLATFORMS") or ["cpu", "h200"])
    ]
    failed = 0
    for case in cases:
        t0 = time.monotonic()
        workdir = (
            a.workdir
            if a.workdir and len(cases) == 1
            else (os.path.join(a.workdir, os.path.relpath(case, CASES)) if a.workdir else None)
        )
        nproc = int(load_case(case)["NPROC"])
        if a.platform != "cpu" and not a.compare_only and nproc > _visible_gpus():
            print(f"SKIPPED {case}: needs {nproc} GPUs, {_visible_gpus()} visible")
            continue
        try:
            if a.launch_only:
                run_case(case, a.platform, workdir=workdir, launch_only=True, oracle=a.oracle, dmi=not a.no_dmi)
                print(f"LAUNCHED {case} -> {workdir} ({time.monotonic() - t0:.1f} s)")
            elif a.record_golden:
                path = record_golden(case, a.platform, workdir=workdir, compare_only=a.compare_only)
                print(f"RECORDED {case} -> {path} ({time.monotonic() - t0:.1f} s)")
            else:
                check_case(case, a.platform, workdir=workdir, compare_only=a.compare_only)
                print(f"PASSED {case} ({time.monotonic() - t0:.1f} s)")
        except CaseFailure as exc:
            failed += 1
            print(f"FAILED {case} ({time.monotonic() - t0:.1f} s)\n{exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
