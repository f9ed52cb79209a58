"""What a tunix job loads of the plugin (staging on, c7d8950's tunix): its activation, then the
modules of tunix's trainer worker and RL program, counted as ../shared/tools/job_lines.py counts
them. No module of the reading layer or the lab among them; what only a setting asks for (a codec,
a tracer, a known driver's flags; the depth or host bound sized each step, the default, not at
their fixed values) loaded only where it is on, and the orchestrator's staged loop only where a
program trains staged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("tunix.experimental.orchestrator.rl_program",
                    reason="tunix's experimental stack (google/tunix main) is not importable")

pytestmark = pytest.mark.tunix

CODE = """
import importlib, json, sys
from tunix_stage_plugin.activation import bootstrap
bootstrap.start()
for m in ("tunix.experimental.worker.trainer_worker", "tunix.experimental.orchestrator.rl_program"):
  importlib.import_module(m)
mods = {m: sum(1 for _ in open(sys.modules[m].__file__)) for m in sys.modules
        if m.startswith("tunix_stage_plugin") and getattr(sys.modules[m], "__file__", None)}
print(json.dumps(mods))
"""
# The most plugin lines a job loads: with the depth and host bound at their fixed values, and at
# the default settings (both auto, sized each step: core.sizing loaded).
MOST = {"fixed": 8000, "default": 8600}


def loaded(**env):
  proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300,
                        env={**os.environ, "JAX_PLATFORMS": "cpu", "TUNIX_STAGE_BATCH": "stage",
                             **env})
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_job_loads_no_reader_and_only_what_its_settings_ask_for():
  fixed = loaded(TUNIX_MAX_STAGED_BATCHES="2", TUNIX_STAGE_MAX_HOST_BATCHES="1")
  default = loaded()  # the depth and host bound auto
  for mods in (fixed, default):
    assert not [m for m in mods if m.startswith(("tunix_stage_plugin.reading",
                                                 "tunix_stage_plugin.lab",
                                                 "tunix_stage_plugin.cli"))], sorted(mods)
  print(f"\nplugin lines a job loads: {sum(fixed.values())} in {len(fixed)} modules at the fixed "
        f"values, {sum(default.values())} in {len(default)} at the default (auto)")
  assert sum(fixed.values()) <= MOST["fixed"] and sum(default.values()) <= MOST["default"]
  sized = {"tunix_stage_plugin.core.sizing"}  # (the report's advice never: core.advice)
  only = {"tunix_stage_plugin.core.sizing", "tunix_stage_plugin.core.advice",
          "tunix_stage_plugin.core.codec", "tunix_stage_plugin.hosts.tunix.compression",
          "tunix_stage_plugin.hosts.tunix.tracing", "tunix_stage_plugin.activation.drivers",
          "tunix_stage_plugin.core.flags", "tunix_stage_plugin.core.pipeline",
          "tunix_stage_plugin.hosts.tunix.run", "tunix_stage_plugin.hosts.tunix.seam_run",
          "tunix_stage_plugin.hosts.tunix.loop_seam"}
  assert not only & set(fixed), sorted(only & set(fixed))
  assert sized <= set(default) and not (only - sized) & set(default), sorted(only & set(default))
