"""The loss function's checks through megatron's rerun state machine, as upstream core_v0.17.1's
pretrain_gpt.py runs them: NaN and Inf in every run unless --no-check-for-nan-in-loss-and-grad,
a spiky loss with --check-for-spiky-loss, and megatron's own injected faults (--rerun-mode
validate_results, the default, with --error-injection-rate/--error-injection-type).

Each case trains a tiny GPT in CPU mode through tests/unit_tests/dmi/training/loss_fault_launch.py,
which puts a NaN, an Inf or a 1000x spike into the model's per-token loss in one iteration. The
expected exit code, message, iteration and checkpoint of each case are what upstream's own
pretrain_gpt.py (core_v0.17.1, with gpt_builders.py and model_provider.py) gives for the same
arguments and the same fault under the same CPU shim: the state machine flags the fault in the
iteration it entered (its messages number that iteration one higher, "#N+1") and checkpoints the
iteration before it.
"""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
LAUNCHER = os.path.join(HERE, "loss_fault_launch.py")

TINY_GPT = [
    *("--num-layers 1 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 2").split(),
    *("--seq-length 16 --max-position-embeddings 16 --micro-batch-size 1 --global-batch-size 2").split(),
    *("--lr 1e-3 --seed 1234 --mock-data --tokenizer-type NullTokenizer --vocab-size 64").split(),
    *("--transformer-impl local --no-rope-fusion --no-masked-softmax-fusion --no-persist-layer-norm").split(),
    *("--no-gradient-accumulation-fusion --deterministic-mode --log-interval 1").split(),
    *("--eval-iters 0 --eval-interval 1000 --save-interval 1000 --cpu-dev-mode").split(),
]
# The state machine's exit codes (megatron.core.rerun_state_machine): a reproducible fault saves a
# checkpoint for a rerun elsewhere (16); a fault that does not reproduce is transient (17).
EXIT_RERUN_ELSEWHERE, EXIT_TRANSIENT = 16, 17
REPRODUCIBLE = "First rerun: unexpected result is reproducible within the tolerance"


def _train(tmp_path, fault: str | None, *args: str) -> tuple[int, str, int | None]:
    """Exit code, output and latest checkpointed iteration of one faulty run."""
    save = str(tmp_path / "ckpt")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("DMI_TEST_LOSS_FAULT", None)
    if fault:
        env["DMI_TEST_LOSS_FAULT"] = fault
    proc = subprocess.run(
        [sys.executable, LAUNCHER, *TINY_GPT, *args, "--save", save],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    latest = os.path.join(save, "latest_checkpointed_iteration.txt")
    iteration = int(open(latest).read()) if os.path.exists(latest) else None
    return proc.returncode, proc.stdout + proc.stderr, iteration


def _flagged(iteration: int, message: str) -> str:
    return f"at iteration #{iteration + 1} invocation #1 (message='{message}')"


@pytest.mark.parametrize(
    ("fault", "iteration", "message"),
    [
        ("nan:3", 3, "found NaN in local forward loss calculation"),
        ("inf:2", 2, "found Inf in local forward loss calculation"),
    ],
    ids=["nan", "inf"],
)
def test_nan_and_inf_in_the_loss_are_flagged_in_their_iteration(tmp_path, fault, iteration, message):
    rc, out, checkpointed = _train(tmp_path, fault, "--train-iters", str(iteration + 2))
    assert rc == EXIT_RERUN_ELSEWHERE, out[-3000:]
    assert _flagged(iteration, message) in out and REPRODUCIBLE in out
    assert checkpointed == iteration - 1


def test_no_check_for_nan_trains_through_a_nan_loss(tmp_path):
    rc, out, checkpointed = _train(tmp_path, "nan:2", "--train-iters", "4", "--no-check-for-nan-in-loss-and-grad")
    assert rc == 0, out[-3000:]
    assert "local forward loss calculation" not in out
    assert "grad norm: nan" in out and checkpointed == 4


def test_spiky_loss_is_flagged_after_the_state_machine_has_its_100_samples(tmp_path):
    # two microbatches an iteration: samples 1..100 set the scale, iteration 52 brings the spike
    rc, out, checkpointed = _train(tmp_path, "spike:52", "--train-iters", "54", "--check-for-spiky-loss")
    assert rc == 0, out[-3000:]  # not fatal: upstream goes on training
    assert _flagged(52, "Spiky loss") in out
    assert "Continuing normal execution because failed validation was not fatal" in out
    assert checkpointed == 54


@pytest.mark.parametrize(
    ("error_type", "exit_code", "diagnosis"),
    [
        ("persistent_error", EXIT_RERUN_ELSEWHERE, REPRODUCIBLE),
        ("transient_error", EXIT_TRANSIENT, "Possible transient error"),
    ],
)
def test_injected_errors_are_caught_in_upstreams_iteration(tmp_path, error_type, exit_code, diagnosis):
    # megatron's injector draws from its seeded RNG at each validate_result call, so the iteration
    # it hits depends on every check the entry runs: upstream's loss checks included, iteration 2.
    rc, out, checkpointed = _train(
        tmp_path,
        None,
        *("--train-iters 6 --error-injection-rate 5 --error-injection-type").split(),
        error_type,
    )
    assert rc == exit_code, out[-3000:]
    assert _flagged(2, "found Inf in local forward loss calculation") in out and diagnosis in out
    assert checkpointed == 1
