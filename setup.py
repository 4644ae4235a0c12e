"""Builds the pybind11 extension `proto._doorbell` (csrc/doorbell.cpp); everything else is in pyproject.toml."""
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "proto._doorbell",
            ["csrc/doorbell.cpp"],
            cxx_std=17,
            extra_compile_args=["-O3"],
        )
    ],
    cmdclass={"build_ext": build_ext},
)
