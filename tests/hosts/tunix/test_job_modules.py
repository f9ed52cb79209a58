"""What each process of a tunix job loads of the plugin (staging on, c7d8950's tunix).

At import (as ../shared/tools/job_lines.py counts it): the activation, the probes and the hooks,
neither role's side. After real staged steps of a two-process job at the default settings (each
process's `python -X importtime` log): at most LIMIT plugin lines per process outside lab/, the
trainer none of what only an orchestrator runs, the orchestrator none of what only a trainer
runs. docs/design.md "Layout".
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import re
import subprocess
import sys

import pytest

pytest.importorskip("tunix.experimental.orchestrator.rl_program",
                    reason="tunix's experimental stack (google/tunix main) is not importable")

from tests.recipes.test_local import assert_nothing_left  # pylint: disable=wrong-import-position
from tests.recipes.test_local import launch  # pylint: disable=wrong-import-position,unused-import
from tests.recipes.test_local import tunix_pythonpath  # pylint: disable=wrong-import-position,unused-import
import tunix_stage_plugin  # pylint: disable=wrong-import-position

pytestmark = pytest.mark.tunix

PACKAGE = Path(tunix_stage_plugin.__file__).parent
P = "tunix_stage_plugin."
LIMIT = 6500  # plugin lines a process of a job carries after its staged steps
AT_IMPORT = 4500  # ... at import, before either role's first call
# What only one role runs.
ORCHESTRATOR_ONLY = {P + m for m in ("core.pipeline", "core.sizing", "transport.sender",
                                     "hosts.tunix.orchestrator", "hosts.tunix.run",
                                     "hosts.tunix.loop_copy", "hosts.tunix.loop_seam")}
# (core.host_bound is both's: the depth's sizer reads the waits and budget it defines.)
TRAINER_ONLY = {P + m for m in ("core.store", "core.executor", "transport.listener",
                                "hosts.tunix.trainer", "hosts.tunix.peft", "hosts.placements")}
# What only a setting that is off by default, or a rare path, asks for.
ON_REQUEST = {P + m for m in ("core.codec", "core.advice", "activation.drivers", "core.flags",
                              "transport.stream")}

CODE = """
import importlib, json, sys
from tunix_stage_plugin.activation import bootstrap
bootstrap.start()
for m in ("tunix.experimental.worker.trainer_worker", "tunix.experimental.orchestrator.rl_program"):
  importlib.import_module(m)
print(json.dumps(sorted(m for m in sys.modules if m.startswith("tunix_stage_plugin"))))
"""


def lines(modules):
  """{module: its lines} of the plugin's modules among `modules`, lab/ left out."""
  out = {}
  for name in modules:
    if not name.startswith(P) or name.startswith(P + "lab"):
      continue
    path = PACKAGE.joinpath(*name.split(".")[1:])
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    if path.is_file():
      out[name] = len(path.read_text(encoding="utf-8").splitlines())
  return out


def test_at_import_a_job_loads_neither_role_s_side_nor_the_reader():
  proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300,
                        env={**os.environ, "JAX_PLATFORMS": "cpu", "TUNIX_STAGE_BATCH": "stage"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  modules = json.loads(proc.stdout.strip().splitlines()[-1])
  assert not [m for m in modules if m.startswith((P + "reading", P + "lab", P + "cli"))], modules
  loaded = lines(modules)
  print(f"\nat import: {sum(loaded.values())} plugin lines in {len(loaded)} modules")
  assert sum(loaded.values()) <= AT_IMPORT
  assert not (ORCHESTRATOR_ONLY | TRAINER_ONLY | ON_REQUEST) & set(loaded), sorted(loaded)


def imported(log: str) -> set[str]:
  """The modules a process's `-X importtime` log says it imported."""
  return set(re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)", log, re.M))


def test_after_staged_steps_each_process_carries_what_it_runs(launch, tmp_path: Path,
                                                             tunix_pythonpath: str):
  """A real two-process job through tunix's runtime (the launcher's small job, 3 staged steps,
  the default settings), each process's imports logged by Python itself."""
  logs = tmp_path / "logs"
  proc = launch("--host", "tunix", "--steps", "3", "--tiny", "--log_dir", str(logs),
                "--timeout", "240", timeout=300, TUNIX_STAGE_BATCH="stage",
                PYTHONPROFILEIMPORTTIME="1", PYTHONPATH=tunix_pythonpath)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert re.search(r"staging on: stage/staged per step \[[1-4], [1-4], [1-4]\]", proc.stdout)
  loaded = {role: lines(imported((logs / f"{role}.log").read_text()))
            for role in ("trainer", "orchestrator")}
  for role, modules in loaded.items():
    layers: dict[str, int] = {}
    for name, n in modules.items():
      layer = "/".join(name.split(".")[1:3 if name.count(".") > 2 else 2])
      layers[layer] = layers.get(layer, 0) + n
    print(f"\n{role}: {sum(modules.values())} plugin lines in {len(modules)} modules: "
          + ", ".join(f"{k} {v}" for k, v in sorted(layers.items())))
    assert sum(modules.values()) <= LIMIT, (role, sorted(modules.items()))
    assert not ON_REQUEST & set(modules), (role, sorted(ON_REQUEST & set(modules)))
  assert not ORCHESTRATOR_ONLY & set(loaded["trainer"]), sorted(loaded["trainer"])
  assert not TRAINER_ONLY & set(loaded["orchestrator"]), sorted(loaded["orchestrator"])
  # Each ran its role: the staging spine's own modules are there.
  assert {P + "core.store", P + "transport.listener"} <= set(loaded["trainer"])
  assert {P + "core.pipeline", P + "core.sizing"} <= set(loaded["orchestrator"])
  assert_nothing_left(launch, proc.stdout)
