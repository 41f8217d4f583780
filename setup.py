"""setuptools entry: an explicit package list keeps ``megatron`` a namespace owned by megatron-core."""
from setuptools import find_namespace_packages, setup

setup(
    packages=find_namespace_packages(include=["megatron.core.dmi*", "megatron.training.dmi*"]),
    package_data={"megatron.core.dmi": ["csrc/*"]},
    include_package_data=True,
)
