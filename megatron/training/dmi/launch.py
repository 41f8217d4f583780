"""DMI inside another entry script: any script that calls ``megatron.training.pretrain``.

    torchrun --nproc-per-node N -m megatron.training.dmi.launch path/to/pretrain_gpt.py \
        <the script's arguments> --dmi-hooks router,attn

The script runs unchanged, as ``__main__``, with ``sys.argv`` as if it had been started itself
(its path, then every argument) and its folder first on ``sys.path``. When a ``--dmi-*`` flag or
``--cpu-dev-mode`` is among the arguments, DMI is activated around the script's ``pretrain`` call
as in the repository's own entry (``megatron.training.dmi.pretrain_gpt``): DMI's flags parsed and
checked with Megatron's (DMI's group chained before the script's own ``extra_args_provider``), the
forward step wrapped, DMI started when ``train()`` is entered, its state written beside every
checkpoint, its end-of-run report, and the CPU development mode. With neither, nothing of DMI is
installed: the script runs exactly as ``python script.py <arguments>`` would.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import NoReturn

from megatron.training.dmi import CPU_DEV_FLAG

USAGE = "usage: python -m megatron.training.dmi.launch SCRIPT [SCRIPT's arguments] [--dmi-* arguments]"


def _usage_error(why: str) -> NoReturn:
    """Stop as argparse stops on a bad argument: the usage, the error, exit 2."""
    sys.stderr.write(f"{USAGE}\nerror: {why}\n")
    sys.exit(2)


def wants_dmi(args: list[str]) -> bool:
    """Whether the arguments ask for anything of DMI: a ``--dmi-*`` flag or ``--cpu-dev-mode``."""
    return any(a.startswith("--dmi-") or a == CPU_DEV_FLAG for a in args)


def main(argv: list[str] | None = None) -> None:
    """Run the entry script named first in ``argv`` (default ``sys.argv[1:]``), with DMI when asked.

    Args:
        argv: the script's path, then its arguments.
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{USAGE}\n\n{__doc__}")
        return
    if not argv:
        _usage_error("name the entry script to run")
    script = argv[0]
    if not os.path.isfile(script):
        _usage_error(f"no entry script at {script!r}: name the Python file that calls pretrain")
    sys.argv = [script, *argv[1:]]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` puts it
    dmi = wants_dmi(sys.argv[1:])
    if dmi:
        from megatron.core.dmi import upstream_patches
        from megatron.training.dmi import entry

        entry.prepare_process(sys.argv, known_only=True)  # the script's own flags go to its own provider
        upstream_patches.install("launch")
    runpy.run_path(script, run_name="__main__")
    if dmi:
        import torch

        # As the repository's entry does: gloo's worker threads can abort the process when left to
        # interpreter finalization.
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
