"""Pretrain a GPT with Deep Model Inspection: the repository's entry script.

    torchrun --nproc-per-node N pretrain_gpt.py <usual Megatron args> --dmi-hooks router,attn

A thin wrapper over the installed entry ``megatron.training.dmi.pretrain_gpt`` (also installed as
the ``megatron-dmi-pretrain-gpt`` console script), so there is one copy of the training code.
"""

from megatron.training.dmi.pretrain_gpt import main

if __name__ == "__main__":
    main()
