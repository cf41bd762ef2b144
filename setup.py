"""Only here to ship the startup hook (a .pth file) into site-packages.

pyproject.toml holds the metadata. setuptools has no declarative way to place a file at the
root of purelib, so build_py copies `cudnn_sdpa_provider_startup.pth` next to the package.
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "cudnn_sdpa_provider_startup.pth"


class BuildPyWithStartupHook(build_py):
    def run(self):
        super().run()
        here = os.path.dirname(os.path.abspath(__file__))
        self.copy_file(os.path.join(here, PTH), os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithStartupHook})
