"""Was staging worth it: `tunix-stage report` on real embedded jobs' records of each kind. Each job
is a trainer_main and an orchestrator_main over 127.0.0.1, each writing its record where staging
is on in it: staged (both on), inline (the orchestrator with staging off, so only the trainer
writes a record), and refused (the trainer with staging off answers every stage unsupported, so
only the orchestrator writes one). What the report predicts is checked against the simulator run
here on the same record; no timing is asserted.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys

import pytest

from tests.cli.test_report import report
from tunix_stage_plugin.lab.embedded import process as process_lib
from tunix_stage_plugin.lab.sim import run as run_lib
from tunix_stage_plugin.lab.sim import trace as trace_lib
from tunix_stage_plugin.reading import records as records_lib

STEPS, MB = 5, 3
# A wire and a host-to-device copy of 2 MiB at 24 MB/s each (0.09 s each), a tiny model's
# compute: inline, each micro-batch's crossing and copy sit between two computations.
JOB = ["--tiny", "--payload_mib", "2", "--wire_mbps", "24", "--h2d_mbps", "24",
       "--steps", str(STEPS), "--microbatches", str(MB), "--stage_log_every", "0"]


def job(folder, *, orchestrator: str, trainer: str) -> tuple[int, int]:
  """A real embedded job writing its records into `folder`, staging `orchestrator` and
  `trainer` (stage or off) in each process: (the trainer's pid, the orchestrator's)."""
  folder.mkdir()
  with process_lib.TrainerProcess(mode=trainer, extra_args=[
      "--stage_metrics", str(folder), "--stage_log_every", "0"]) as trainer_proc:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tunix_stage_plugin.lab.embedded.orchestrator_main", "--trainer",
         trainer_proc.address, *JOB, "--stage_train_batches", orchestrator, "--stage_metrics",
         str(folder)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, out + err[-3000:]
  return trainer_proc.pid, proc.pid


@pytest.fixture(name="jobs", scope="module")
def fixture_jobs(tmp_path_factory):
  root = tmp_path_factory.mktemp("jobs")
  return {kind: (str(root / kind), *job(root / kind, orchestrator=o, trainer=t))
          for kind, o, t in (("staged", "stage", "stage"), ("inline", "off", "stage"),
                             ("refused", "stage", "off"))}


def summary_of(folder):
  (run,) = json.loads(report(folder, "--json").stdout)["runs"]  # one job's records: one run
  return run["summary"]


def overall(out):
  """The lines of the overall block."""
  lines = out.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith("overall ("))
  return [line.strip() for line in lines[start + 1:] if line.startswith("  ")]


def replayed(folder, mode):
  """The simulator's mean step after the first on the folder's trainer record, in `mode`, with
  the trainer's bounds as its last step ran with."""
  trainer = records_lib.read([folder]).steps["trainer"]
  result = run_lib.simulate(trace_lib.of_steps(trainer, folder), mode,
                            max_device_batches=int(trainer["max_device_batches"].iloc[-1]),
                            max_host_batches=int(trainer["max_host_batches"].iloc[-1]))
  return math.fsum(result.step_s) / len(result.step_s)


def test_a_staged_job_says_what_staging_hid(jobs):
  folder, _, _ = jobs["staged"]
  summary = summary_of(folder)
  assert summary["staging"] == {"staged": True, "said": None, "role": None, "turn_on": None}
  assert summary["trainer"]["hidden_s"] is not None
  assert summary["orchestrator"]["staged"] > 0
  said = overall(report(folder).stdout)
  assert [line for line in said if line.startswith("staging hid ")] == [
      f"staging hid {summary['trainer']['hidden_s']:.2f} s a step of an inline estimate of "
      f"{summary['trainer']['inline_wait_estimate_s']:.2f} s of input wait"
      f" ({summary['trainer']['hidden_s'] / summary['trainer']['inline_wait_estimate_s']:.0%})"]
  assert not [line for line in said if line.startswith("did not stage")]


def test_an_inline_job_says_it_did_not_stage_and_recommends_turning_it_on(jobs):
  """The orchestrator ran with staging off and wrote no record; the trainer's record says every
  micro-batch was placed inline. The report says so in one line naming the trainer, with the
  setting that turns staging on and what the simulator predicts at the default on this record."""
  folder, trainer_pid, _ = jobs["inline"]
  before, after = replayed(folder, "inline"), replayed(folder, "auto")
  assert after < before  # the simulator's arithmetic: staged, a crossing hides behind a copy
  summary = summary_of(folder)
  assert summary["staging"] == {
      "staged": False, "role": "orchestrator",
      "turn_on": "TUNIX_STAGE_BATCH=stage on the orchestrator",
      "said": "the orchestrator sent every micro-batch with its train call (staging off on it, "
              f"or no plugin there: it wrote no record), and trainer {socket.gethostname()}:"
              f"{trainer_pid} placed all {STEPS * MB} inline"}
  assert summary["trainer"]["hidden_s"] is None
  assert summary["replay"] == {"mode": "inline", "step_s": pytest.approx(before)}
  (advice,) = summary["advice"]
  assert advice["kind"] == "staging off" and advice["recommended"]
  assert advice["prediction"] == {"before_s": pytest.approx(before),
                                  "after_s": pytest.approx(after)}
  assert summary["recommendations"] == [advice["line"]]
  out = report(folder).stdout
  said = overall(out)
  assert [line for line in said if line.startswith("did not stage: ")] == [
      f"did not stage: {summary['staging']['said']}; turned on by TUNIX_STAGE_BATCH=stage on "
      f"the orchestrator: at the default, simulate predicts {after:.2f} s a step against "
      f"{before:.2f} s inline on this record"]
  assert not [line for line in said if line.startswith("staging hid")]
  assert f"checked by simulate: its replay of the record as inline takes {before:.2f} s a step " \
      "with the job's settings" in out
  last = out.splitlines()[-1]
  assert last.startswith("recommendation: TUNIX_STAGE_BATCH=stage on the orchestrator: turns "
                         "staging on, its depth sized each step (auto, the default); decided by "
                         f"micro-batches placed inline {MB} (in {STEPS} of {STEPS} steps)")
  assert last.endswith(f"simulate predicts {before:.2f} s -> {after:.2f} s a step "
                       "(inline -> auto)")


def test_a_job_whose_trainer_refused_staging_says_so_and_that_nothing_replays_it(jobs):
  """The trainer ran with staging off: it answered the orchestrator's first stage unsupported and
  wrote no record; the orchestrator's record says so. With no trainer record, the simulator has
  nothing to replay, and the report says why."""
  folder, _, orchestrator_pid = jobs["refused"]
  summary = summary_of(folder)
  assert summary["orchestrator"]["fallbacks_by_kind"] == {"unsupported": 1}
  assert summary["orchestrator"]["staged"] == 0 and "trainer" not in summary
  where = f"orchestrator {socket.gethostname()}:{orchestrator_pid}"
  assert summary["staging"] == {
      "staged": False, "role": "trainer",
      "turn_on": "TUNIX_STAGE_BATCH=stage on the trainer, with the plugin installed there",
      "said": f"the trainer refused {where}'s stages as unsupported (staging is off on the "
              f"trainer, or it runs without the plugin), so all {STEPS * MB} micro-batches "
              "trained inline"}
  assert summary["replay"] is None
  (advice,) = summary["advice"]
  assert advice["recommended"] and advice["prediction"] is None
  assert advice["checked"].startswith("not checked (no trainer record to replay")
  out = report(folder).stdout
  said = overall(out)
  assert said[0] == (f"did not stage: {summary['staging']['said']}; turned on by "
                     f"{summary['staging']['turn_on']}; what it would give is "
                     f"{advice['checked']}")
  assert "checked by simulate" not in out and "nothing to change" not in out
  assert out.splitlines()[-1] == f"recommendation: {advice['line']}"


def test_report_staged_inline_compares_them_and_says_which_did_not_stage(jobs):
  staged, inline = jobs["staged"][0], jobs["inline"][0]
  out = report(staged, inline).stdout.splitlines()
  assert out[0].startswith(f"A: {staged} (") and out[1].startswith(f"B: {inline} (")
  row = next(line.split() for line in out if "stage/placed_inline" in line)
  assert row[:3] == ["trainer", "stage/placed_inline", "0"] and row[3] == str(MB)
  a_said = next(line for line in out if line.startswith("A: bound by "))
  b_said = next(line for line in out if line.startswith("B: bound by "))
  assert "; staging hid " in a_said and "did not stage" not in a_said
  assert b_said.endswith(f"; did not stage: {summary_of(inline)['staging']['said']}")
  assert out[-1].startswith("B: recommendation: TUNIX_STAGE_BATCH=stage on the orchestrator: ")


def test_report_a_a_says_it_was_given_twice_and_compares_nothing(jobs):
  folder = jobs["staged"][0]
  out = report(folder, folder).stdout
  assert out.splitlines()[0] == (f"note: {folder} was given twice: read once; nothing compared "
                                 "(report A B compares two runs)")
  assert out.count("run: ") == 1 and "medians a step" not in out and "A: " not in out
  assert out.split("\n", 1)[1] == report(folder).stdout
  data = json.loads(report(folder, folder, "--json").stdout)
  assert data["notes"] == [out.splitlines()[0].removeprefix("note: ")]
  assert "figures" not in data and len(data["runs"]) == 1
