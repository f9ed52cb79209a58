"""What a tunix job loads of the plugin (staging on, c7d8950's tunix): its activation, then the
modules of tunix's trainer worker and RL program, counted as ../shared/tools/job_lines.py counts
them. No module of the reading layer or the lab among them; what only a setting asks for (the
depth or host bound sized each step, a codec, a tracer, a known driver's flags) loaded only where
it is on, and the orchestrator's staged loop only where a program trains staged.
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
# The most plugin lines a job loads: at the default settings, and with depth and host bound auto.
MOST = {"default": 8000, "auto": 8600}


def loaded(**env):
  proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300,
                        env={**os.environ, "JAX_PLATFORMS": "cpu", "TUNIX_STAGE_BATCH": "stage",
                             **env})
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_job_loads_no_reader_and_only_what_its_settings_ask_for():
  default = loaded()
  auto = loaded(TUNIX_MAX_STAGED_BATCHES="auto", TUNIX_STAGE_MAX_HOST_BATCHES="auto")
  for mods in (default, auto):
    assert not [m for m in mods if m.startswith(("tunix_stage_plugin.reading",
                                                 "tunix_stage_plugin.lab",
                                                 "tunix_stage_plugin.cli"))], sorted(mods)
  print(f"\nplugin lines a job loads: {sum(default.values())} in {len(default)} modules, "
        f"{sum(auto.values())} in {len(auto)} at auto")
  assert sum(default.values()) <= MOST["default"] and sum(auto.values()) <= MOST["auto"]
  only = {"tunix_stage_plugin.core.sizing", "tunix_stage_plugin.core.advice",
          "tunix_stage_plugin.core.codec", "tunix_stage_plugin.hosts.tunix.compression",
          "tunix_stage_plugin.hosts.tunix.tracing", "tunix_stage_plugin.activation.drivers",
          "tunix_stage_plugin.core.flags", "tunix_stage_plugin.core.pipeline",
          "tunix_stage_plugin.hosts.tunix.run", "tunix_stage_plugin.hosts.tunix.seam_run",
          "tunix_stage_plugin.hosts.tunix.loop_seam"}
  assert not only & set(default), sorted(only & set(default))
  assert {"tunix_stage_plugin.core.sizing", "tunix_stage_plugin.core.advice"} <= set(auto)
