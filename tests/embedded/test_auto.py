"""Staging that sizes itself on the embedded host (docs/configuration.md "Staging that sizes
itself"): a real trainer_main at TUNIX_STAGE_MAX_HOST_BATCHES=auto and a real orchestrator_main at
TUNIX_MAX_STAGED_BATCHES=auto train to the parameters of the same job inline, every micro-batch
once and in order, and each process's record says each step's choice and why.
"""

from __future__ import annotations

import subprocess
import sys

from tests.embedded.test_mains import _digest, _orchestrate
from tests.records import job_records
from tunix_stage_plugin.core.telemetry import record as record_lib
from tunix_stage_plugin.lab.embedded import process as process_lib

STEPS = "5"


def test_a_job_at_auto_trains_the_parameters_of_the_job_inline_and_says_each_choice(tmp_path):
  folder = tmp_path / "metrics"
  with process_lib.TrainerProcess(max_host_batches="auto",
                                  extra_args=["--stage_metrics", str(folder)]) as trainer:
    auto = _orchestrate(trainer.address, "--steps", STEPS, TUNIX_STAGE_BATCH="stage",
                        TUNIX_MAX_STAGED_BATCHES="auto", TUNIX_STAGE_MEMORY_BUDGET="64MiB",
                        TUNIX_STAGE_METRICS=str(folder))
    inline = _orchestrate(trainer.address, "--steps", STEPS, "--stage_train_batches", "off")
  assert auto.returncode == 0 and inline.returncode == 0, auto.stderr + inline.stderr
  summary = auto.stdout.strip().splitlines()[-1]
  # The fixed default's depth until a step is measured (steps 0 and 1: the second's is chosen
  # before the first ends).
  assert "staging stage depth=auto (per step [2, 2, " in summary and "prestage=on" in summary
  assert "trained once in order: yes" in summary
  assert _digest(auto.stdout) == _digest(inline.stdout)  # the same parameters, bit for bit

  by_role = job_records(folder)
  orchestrator = by_role[record_lib.ORCHESTRATOR]
  assert [r["step"] for r in orchestrator] == list(range(int(STEPS)))
  for r in orchestrator:
    assert r["sizing"].startswith(f"depth {r['depth']}: ") and "budget 64.0 MiB" in r["sizing"]
    assert r["settings"]["max_staged_batches"] == r["depth"]
  assert any("no step measured yet" not in r["sizing"] for r in orchestrator[2:]), orchestrator
  trainer_records = by_role[record_lib.TRAINER]
  assert len(trainer_records) >= int(STEPS)
  for r in trainer_records[:int(STEPS)]:  # the staged job's run
    bound = r["settings"]["max_host_batches"]
    assert r["sizing"].startswith(f"host bound {bound}: ")
  # Each step's line says the choice too.
  assert ("; depth 2: the default (no step measured yet); budget 64.0 MiB, a micro-batch's size "
          "not known yet") in auto.stderr
  # And report: each process's table followed by its steps' choices.
  out = subprocess.run([sys.executable, "-m", "tunix_stage_plugin", "report", str(folder)],
                       capture_output=True, text=True, timeout=120, check=True).stdout
  assert f"  step 4: {orchestrator[4]['sizing']}" in out.splitlines()
  assert any(line.startswith("  step 4: host bound ") for line in out.splitlines()), out
  # Its run's settings say what was sized (not the last step's values, which read as fixed).
  (label,) = [line for line in out.splitlines() if line.startswith("run:") and "orchestrator" in line]
  assert "max_staged_batches=auto" in label and "max_host_batches=auto" in label, label
