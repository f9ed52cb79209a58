"""Ships tunix_stage_plugin.pth into site-packages; every piece of metadata is in setup.cfg.

A .pth file must sit at the root of site-packages, which package data cannot reach, so build_py
copies it there: into build_lib for a regular wheel, and into the editable wheel's install
directory for `pip install -e .` (PEP 660 builds that wheel from there, not from build_lib).
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = os.path.join("tunix_stage_plugin", "activation", "tunix_stage_plugin.pth")


class BuildPyWithPth(build_py):

  def run(self):
    super().run()
    if self.editable_mode:
      target = self.get_finalized_command("install").install_lib
    else:
      target = self.build_lib
    self.copy_file(PTH, os.path.join(target, os.path.basename(PTH)))


setup(cmdclass={"build_py": BuildPyWithPth})
