"""Packaging hooks: build_py builds libecmooncake.so and the ecm-ceiling command
(the benchmarks' TCP ceiling, started by ecmooncake.tools.ceiling) into the package
(or copies an earlier build from $ECMOONCAKE_PREBUILT), and the wheel is tagged
for the platform because it carries native code.

Metadata lives in pyproject.toml.
"""

import importlib.util
import os
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1 keeps it in the wheel package
    from wheel.bdist_wheel import bdist_wheel

ROOT = Path(__file__).resolve().parent


def _build_lib_module():
    # Loaded by path: the folder is named build/, which must not shadow the
    # PyPA 'build' package as an import.
    spec = importlib.util.spec_from_file_location("build_lib", ROOT / "build" / "build_lib.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithLibrary(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            out = ROOT / "python" / "ecmooncake"
        else:
            out = Path(self.build_lib) / "ecmooncake"
        build_lib = _build_lib_module()
        prebuilt = os.environ.get(build_lib.PREBUILT_ENV)
        if prebuilt:
            build_lib.copy_prebuilt(prebuilt, out)
        else:
            build_lib.build(out)


class BinaryDistribution(Distribution):
    # The package carries a native library: install it as platform-specific
    # (platlib, wheel root) even though it has no Python extension module.
    def has_ext_modules(self):
        return True


class PlatformWheel(bdist_wheel):
    def get_tag(self):
        # The library is called through ctypes, so any CPython 3 on this
        # platform can use the wheel: no interpreter or ABI tag applies.
        _, _, platform = super().get_tag()
        return "py3", "none", platform


setup(
    distclass=BinaryDistribution,
    cmdclass={"build_py": BuildPyWithLibrary, "bdist_wheel": PlatformWheel},
)
