"""Staging that sizes itself in a real two-process tunix job (docs/configuration.md "Staging that
sizes itself"): a trainer node of tunix's own server, TrainerWorker and PeftTrainer with the
plugin installed at TUNIX_STAGE_MAX_HOST_BATCHES=auto, this process the orchestrator at
TUNIX_MAX_STAGED_BATCHES=auto, both writing their records; the same job trained by a node
without the plugin (tunix alone) is the reference. The parameters are bitwise equal, every
micro-batch trained once, and each step's record carries its choice and why: the orchestrator's
depth (from the trainer's newest closed step, riding on each stage answer), the trainer's host
bound.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("tunix.experimental.orchestrator.rl_program",
                    reason="tunix's experimental stack (google/tunix main) is not importable")

from tests.hosts.tunix import test_grpc  # pylint: disable=wrong-import-position
from tests.records import job_records  # pylint: disable=wrong-import-position

pytestmark = pytest.mark.tunix
STEPS = 5


@pytest.mark.loop_way
def test_a_job_at_auto_trains_the_parameters_of_the_job_inline_and_says_each_choice(tmp_path):
  folder = tmp_path / "metrics"
  nodes = [test_grpc._start_node("observed", **{test_grpc.NODE_METRICS: str(folder),  # pylint: disable=protected-access
                                                "TUNIX_STAGE_MAX_HOST_BATCHES": "auto"}),
           test_grpc._start_node("bare")]  # pylint: disable=protected-access
  job = [test_grpc.batch(n) for n in range(STEPS * test_grpc.MICRO)]
  try:
    auto, inputs, reports = test_grpc.run_program(
        nodes[0][1]["observed"], staged=True, payloads=job, steps=STEPS,
        settings={"metrics": str(folder), "max_staged_batches": "auto", "memory_budget": "1GiB"})
    inline, inline_inputs, _ = test_grpc.run_program(nodes[1][1]["bare"], staged=False,
                                                     payloads=job, steps=STEPS)
  finally:
    for proc, _ in nodes:
      test_grpc._stop_node(proc)  # pylint: disable=protected-access
  assert inline_inputs == ["host"] * (STEPS * test_grpc.MICRO)
  assert len(inputs) == STEPS * test_grpc.MICRO  # every micro-batch trained once
  assert sum(r.stage_metrics["stage/staged"] for r in reports) == inputs.count("P('fsdp',)") > 0
  assert auto.keys() == inline.keys() and auto == inline  # byte for byte

  by_role = job_records(folder)
  orchestrator, trainer = by_role["orchestrator"], by_role["trainer"]
  assert [r["step"] for r in orchestrator] == list(range(STEPS))
  for r in orchestrator:  # the depth in force, carried as a setting, and why
    assert r["sizing"].startswith(f"depth {r['depth']}: ") and "budget 1.00 GiB" in r["sizing"]
    assert r["settings"]["max_staged_batches"] == r["depth"] >= 1
  assert orchestrator[0]["sizing"] == ("depth 2: the default (no step measured yet); budget "
                                       "1.00 GiB, a micro-batch's size not known yet")
  # The trainer's step numbers reached the orchestrator's choice (on the stage answers).
  assert any("no step measured yet" not in r["sizing"] for r in orchestrator[2:]), orchestrator
  for r in trainer:
    bound = r["settings"]["max_host_batches"]
    assert isinstance(bound, int) and r["sizing"].startswith(f"host bound {bound}: ")


@pytest.mark.loop_way
def test_a_job_at_the_default_settings_trains_as_inline_and_report_reads_both_records(tmp_path):
  """The one variable a user sets, and a metrics folder, in one environment both processes are
  given: the trainer node activated by it as a job's is, this process the orchestrator reading
  it; the depth and the host bound at their default, auto. The parameters are bitwise those of
  tunix alone, and `tunix-stage report` and `simulate` read both processes' records."""
  folder = tmp_path / "metrics"
  env = {"TUNIX_STAGE_BATCH": "stage", "TUNIX_STAGE_METRICS": str(folder)}
  nodes = [test_grpc._start_node("environment", **env),  # pylint: disable=protected-access
           test_grpc._start_node("bare")]  # pylint: disable=protected-access
  job = [test_grpc.batch(n) for n in range(STEPS * test_grpc.MICRO)]
  try:
    staged, inputs, reports = test_grpc.run_program(
        nodes[0][1]["environment"], staged=True, payloads=job, steps=STEPS, env=env)
    inline, _, _ = test_grpc.run_program(nodes[1][1]["bare"], staged=False, payloads=job,
                                         steps=STEPS)
  finally:
    for proc, _ in nodes:
      test_grpc._stop_node(proc)  # pylint: disable=protected-access
  assert len(inputs) == STEPS * test_grpc.MICRO  # every micro-batch trained once
  assert sum(r.stage_metrics["stage/staged"] for r in reports) == inputs.count("P('fsdp',)") > 0
  assert staged.keys() == inline.keys() and staged == inline  # byte for byte

  by_role = job_records(folder)  # the reading layer reads every record (raises otherwise)
  orchestrator, trainer = by_role["orchestrator"], by_role["trainer"]
  assert orchestrator[0]["sizing"].startswith("depth 2: the default (no step measured yet)")
  assert set(orchestrator[0]["settings"]) == {"max_staged_batches", "codec"}
  assert set(trainer[0]["settings"]) == {"max_device_batches", "max_host_batches"}
  assert all(r["sizing"].startswith("host bound ") for r in trainer)
  cli = [sys.executable, "-m", "tunix_stage_plugin"]
  out = subprocess.run([*cli, "report", str(folder)], capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0, out.stderr
  (label,) = [line for line in out.stdout.splitlines() if line.startswith("run:")]
  assert "trainer " in label and "orchestrator " in label, label
  assert "max_staged_batches=auto" in label and "max_host_batches=auto" in label, label
  out = subprocess.run([*cli, "simulate", str(folder), "--modes", "depth2_prestage,auto"],
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
