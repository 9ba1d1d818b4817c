"""Builds fbmt's native extension fbmt._C (pybind11, no libtorch). Metadata lives in pyproject.toml."""

import os
import shutil
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

try:
    from pybind11.setup_helpers import Pybind11Extension
except ImportError:
    sys.exit("fbmt: building the native extension needs pybind11 in this environment: "
             "`pip install pybind11` (or install with build isolation, without --no-build-isolation).")


class BuildExt(build_ext):
    """Fails with one clear sentence when there is no C++ compiler (instead of a distutils trace)."""

    def run(self):
        compiler = os.environ.get("CXX", "c++")
        if not (shutil.which(compiler) or shutil.which("g++") or shutil.which("clang++")):
            sys.exit("fbmt: no C++ compiler found (looked for $CXX, c++, g++, clang++); fbmt._C (the CPU Adam "
                     "for optimizer offload) needs one: on Debian/Ubuntu `apt-get install g++`, then reinstall.")
        super().run()


native = Pybind11Extension(
    "fbmt._C",
    ["fbmt/csrc/adam.cpp"],
    cxx_std=17,
    extra_compile_args=["-O3", "-fno-math-errno", "-ffp-contract=off", "-Wall"],  # same rounding on every SIMD level
)
setup(ext_modules=[native], cmdclass={"build_ext": BuildExt})
