"""Builds the pybind11 extensions `symbiont.proto._doorbell` (csrc/doorbell.cpp) and `symbiont.proto._stream_ops`
(csrc/stream_ops.cpp), which share csrc/shm.h; everything else is in pyproject.toml."""
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "symbiont.proto._doorbell",
            ["csrc/doorbell.cpp"],
            depends=["csrc/shm.h"],
            cxx_std=17,
            extra_compile_args=["-O3"],
        ),
        Pybind11Extension(
            "symbiont.proto._stream_ops",
            ["csrc/stream_ops.cpp"],
            depends=["csrc/shm.h"],
            cxx_std=17,
            extra_compile_args=["-O3"],
            libraries=["dl"],
        ),
    ],
    cmdclass={"build_ext": build_ext},
)
