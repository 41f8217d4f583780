"""setuptools entry: an explicit package list keeps ``megatron`` a namespace owned by megatron-core.

``pip install .`` ships the native ring sources: build_py copies csrc/dmi into
megatron/core/dmi/csrc inside the build, where megatron.core.dmi.transport.jit looks first.
``pip install -e .`` needs no copy: jit finds them at the repo's csrc/dmi.
"""

import shutil
from pathlib import Path

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py

CSRC = Path(__file__).resolve().parent / "csrc" / "dmi"


class BuildPyWithCsrc(build_py):
    def run(self):
        super().run()
        if self.editable_mode or not CSRC.is_dir():
            return
        dest = Path(self.build_lib) / "megatron" / "core" / "dmi" / "csrc"
        dest.mkdir(parents=True, exist_ok=True)
        for src in CSRC.iterdir():
            if src.is_file() and src.suffix in (".h", ".cuh", ".cpp", ".cu"):
                shutil.copy2(src, dest / src.name)


setup(
    # megatron_dmi: the fast CLI's package (the `megatron-dmi` command and the ingester process run it)
    packages=find_namespace_packages(include=["megatron.core.dmi*", "megatron.training.dmi*", "megatron_dmi"]),
    package_data={"megatron.core.dmi": ["csrc/*"]},
    include_package_data=True,
    cmdclass={"build_py": BuildPyWithCsrc},
)
