"""Only here to ship the startup hook (a .pth file) into site-packages, for every install mode.

pyproject.toml holds the metadata. setuptools has no declarative way to place a file at the
root of purelib, so:
- ``pip install .`` (a wheel): build_py copies `cudnn_sdpa_provider_startup.pth` next to the package;
- ``pip install -e .`` (PEP 660 editable wheel): editable_wheel ignores build_py's files outside the
  packages, so it adds the .pth to the editable wheel's root itself. The hook imports the package
  through the editable finder like any other import, so it runs the checkout's code.
"""
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "cudnn_sdpa_provider_startup.pth"
HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithStartupHook(build_py):
    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            self.copy_file(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        extra = [] if getattr(self, "editable_mode", False) else [os.path.join(self.build_lib, PTH)]
        return super().get_outputs(include_bytecode) + extra


class EditableWheelWithStartupHook(editable_wheel):
    # _run_build_commands (setuptools >= 64) fills the directory whose whole content becomes the
    # wheel's root (purelib); a file put there is installed into site-packages as is.
    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
        result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        shutil.copyfile(os.path.join(HERE, PTH), os.path.join(unpacked_wheel, PTH))
        return result


setup(cmdclass={"build_py": BuildPyWithStartupHook, "editable_wheel": EditableWheelWithStartupHook})
