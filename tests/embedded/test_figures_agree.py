"""The job's figures agree with each other: a real embedded job (trainer_main and
orchestrator_main, real gRPC on 127.0.0.1) writes its records, and what each process's per-step
line says, what `tunix-stage report` totals and the tables it sums count the same calls.

No timing is asserted: only counts, bytes, and the words that name them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.cli.test_report import report
from tunix_stage_plugin.core.telemetry import figures as figures_lib
from tunix_stage_plugin.lab.embedded import process as process_lib

STEPS, MB = 3, 3


def job(folder, payload_mib: str) -> tuple[str, str]:
  """A staged job of STEPS x MB micro-batches writing its records into `folder`: (the trainer's
  stderr, the orchestrator's)."""
  log = folder / "trainer.err"
  with open(log, "w", encoding="utf-8") as err, process_lib.TrainerProcess(
      extra_args=["--stage_metrics", str(folder), "--stage_log_every", "1"],
      stderr=err) as trainer:
    orch = subprocess.run(
        [sys.executable, "-m", "tunix_stage_plugin.lab.embedded.orchestrator_main", "--trainer",
         trainer.address, "--steps", str(STEPS), "--microbatches", str(MB), "--tiny",
         "--payload_mib", payload_mib, "--stage_train_batches", "stage", "--stage_metrics",
         str(folder)], capture_output=True, text=True, timeout=240, check=False)
  assert orch.returncode == 0, orch.stdout + orch.stderr
  return log.read_text(encoding="utf-8"), orch.stderr


def reported(folder) -> tuple[str, dict]:
  """`tunix-stage report` on the folder: its text and its one run's JSON."""
  text = report(str(folder)).stdout
  (one,) = json.loads(report(str(folder), "--json").stdout)["runs"]  # one job's: one run
  return text, one


def step_lines(stderr: str, who: str) -> list[str]:
  return [line for line in stderr.splitlines() if line.startswith(f"tunix-stage: {who}step ")]


def test_received_and_sent_totals_count_every_step_as_their_tables_do(tmp_path):
  """4 MiB micro-batches go by the bulk channel (the side channel): the trainer's received total
  and the orchestrator's sent total are the same calls, step 0's among them, and each equals the
  sum of its table."""
  trainer_err, orch_err = job(tmp_path, "4")
  text, data = reported(tmp_path)
  trainer, orch = data["processes"]
  received = data["summary"]["trainer"]["received"]["side"]
  sent = data["summary"]["orchestrator"]["sent"]["side"]
  assert received["calls"] == sum(r["receive"]["calls"] for r in trainer["records"])
  assert sent["calls"] == sum(r["sent"]["side"]["calls"] for r in orch["records"])
  assert received["calls"] == sent["calls"] and received["bytes"] == sent["bytes"]
  assert trainer["records"][0]["receive"]["calls"] > 0  # step 0 received: it is counted
  summary = data["summary"]["trainer"]
  assert sum(summary["bound_by"].values()) + summary["first_steps"] == len(trainer["records"])
  assert "totals are over every step" in text
  (overall,) = [l for l in text.splitlines() if l.strip().startswith("trainer step: median")]
  assert re.search(r" s = compute \d+\.\d\d( \([^()+]*\))? \+ input wait ", overall), overall
  assert f"received by side channel: {received['calls']} calls, " in text
  assert f"sent by side channel: {sent['calls']} calls, " in text
  # Every per-step line: the slowdown inside the compute, never a term of the sum.
  trainer_lines = step_lines(trainer_err, "trainer ")
  assert len(trainer_lines) == STEPS
  for line in trainer_lines:
    assert re.search(r" s = compute \d+\.\d\d( \([^()+]*\))? \+ input wait ", line), line
    assert re.search(r"received \d x 4\.0 MiB by side channel", line), line
  assert all(re.search(r"sent \d x 4\.0 MiB by side channel", line)
             for line in step_lines(orch_err, ""))


def test_a_tiny_job_s_lines_name_the_transport_and_the_size_it_used(tmp_path):
  """50 KiB micro-batches travel inside the gRPC call, which the trainer does not time as a
  receive: the orchestrator says so (never "0.0 MiB by side channel"), the trainer that it
  received nothing by side channel or stream."""
  trainer_err, orch_err = job(tmp_path, "0.05")
  orch_lines = step_lines(orch_err, "")
  assert len(orch_lines) == STEPS
  assert all(re.search(r"sent \d x \d+\.\d KiB by gRPC call", line) for line in orch_lines), \
      orch_lines
  assert all("received nothing by side channel or stream" in line
             for line in step_lines(trainer_err, "trainer "))
  _, data = reported(tmp_path)
  assert "side" not in data["summary"]["orchestrator"]["sent"]
  assert data["summary"]["trainer"]["received"] == {}


@pytest.mark.parametrize("nbytes, shown", [(0, "0.0 KiB"), (51 << 10, "51.0 KiB"),
                                           (16 << 20, "16.0 MiB"), (int(1.5 * (1 << 30)),
                                                                    "1.50 GiB")])
def test_sizes_show_in_the_unit_that_shows_them(nbytes, shown):
  assert figures_lib.size(nbytes) == shown
