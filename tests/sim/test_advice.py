"""`tunix-stage report`'s advice checked against the simulator (lab/sim/advice.py): a change is
recommended only where `simulate` on the same record predicts a shorter step, and the report says
by how much and which figure decided. The two cases of issue 42: a real embedded job bound by its
wire in every step, and a job bound by the wire in 3 of its 7 steps.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tunix_stage_plugin.core import advice as advice_lib
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.telemetry import process
from tunix_stage_plugin.core.telemetry import record as record_lib
from tunix_stage_plugin.core.telemetry.recorder import Span
from tunix_stage_plugin.reading import records as records_lib
from tunix_stage_plugin.reading import report as report_cmd
from tunix_stage_plugin.lab.embedded import process as process_lib
from tunix_stage_plugin.lab.sim import advice as check_lib
from tunix_stage_plugin.lab.sim import trace as trace_lib
from tests.cli.test_report import report
from tests.core.test_telemetry import compute

MIB = 1 << 20


def report_json(folder):
  (run,) = json.loads(report(str(folder), "--json").stdout)["runs"]  # one job's records: one run
  return run["summary"]


def report_text(folder):
  return report(str(folder)).stdout


def simulated(folder, settings, wire=1.0):
  """What `simulate` predicts on the folder's record: its mean step after the first."""
  trainer = records_lib.read([str(folder)]).steps[record_lib.TRAINER]
  trace = trace_lib.of_steps(trainer, str(folder)).scaled({"wire": wire})
  return check_lib.mean_step(trace, settings)


def run_wire_bound_job(folder, *depth):
  """A real embedded job (a trainer process and orchestrator_main over 127.0.0.1) whose wire
  (2 MiB micro-batches at 12 MB/s: 0.17 s each) is far slower than its tiny model's compute
  (milliseconds), writing its records into `folder`; `depth`: the orchestrator's depth flags
  (none: auto, the default)."""
  with process_lib.TrainerProcess(extra_args=["--stage_metrics", str(folder),
                                              "--stage_log_every", "0"]) as trainer:
    orchestrator = subprocess.run(
        [sys.executable, "-m", "tunix_stage_plugin.lab.embedded.orchestrator_main",
         "--trainer", trainer.address, "--tiny", "--payload_mib", "2", "--wire_mbps", "12",
         "--steps", "6", "--microbatches", "4", "--stage_train_batches", "stage", *depth,
         "--stage_metrics", str(folder), "--stage_log_every", "0"],
        capture_output=True, text=True, timeout=300)
  assert orchestrator.returncode == 0, orchestrator.stderr[-3000:]
  return folder


@pytest.fixture(name="wire_bound_job", scope="module")
def fixture_wire_bound_job(tmp_path_factory):
  """The wire-bound job at depth 1: every step is bound by the wire. Its metrics folder."""
  return run_wire_bound_job(tmp_path_factory.mktemp("wire12"), "--max_staged_batches", "1")


def test_a_job_bound_by_its_wire_is_told_the_codec_or_bandwidth_with_the_prediction(
    wire_bound_job):
  summary = report_json(wire_bound_job)
  # every step but the first, its compile (counts are over every step; a first counted apart)
  assert summary["trainer"]["bound_by"]["wire"] == 5 and summary["trainer"]["first_steps"] == 1
  advice = {a["kind"]: a for a in summary["advice"]}
  # Never "raise the depth" (the wire is the bound: no depth can hide it), never tunix's knob.
  assert advice_lib.DEPTH not in advice
  assert not any("max_staleness" in line for line in summary["recommendations"])
  wire = advice[advice_lib.WIRE]
  assert wire["recommended"] and "no depth beyond 1 can hide it" in wire["why"]
  assert wire["figure"]["name"] == "input wait mid-step" and wire["figure"]["steps"] == 5
  # The prediction beside it is the simulator's on the same record: the job's settings (depth 1,
  # nothing prestaged, the trainer's bounds), then the wire halved.
  settings = advice_lib.Settings(host="embedded", depth=1, prestage=False, max_device_batches=1,
                                 max_host_batches=1)
  before, after = simulated(wire_bound_job, settings), simulated(wire_bound_job, settings, 0.5)
  assert wire["prediction"] == {"before_s": pytest.approx(before), "after_s": pytest.approx(after)}
  assert after < 0.7 * before
  # The boundary's wait is named by the embedded job's own knob (its depth), where simulate
  # predicts it helps.
  if advice_lib.PRESTAGE in advice:
    assert advice[advice_lib.PRESTAGE]["setting"].startswith("TUNIX_MAX_STAGED_BATCHES=2 (the "
                                                             "embedded job prestages")
  text = report_text(wire_bound_job)
  assert f"checked by simulate: its replay of the record as depth1 takes {before:.2f} s a step " \
      "with the job's settings (the job measured " in text
  line = next(l for l in text.splitlines() if l.startswith("recommendation: compress"))
  assert f"simulate predicts {before:.2f} s -> {after:.2f} s a step (the wire x0.5)" in line
  assert "decided by input wait mid-step" in line and "(in 5 of 5 steps)" in line


def test_at_auto_the_wire_bound_is_worded_as_what_a_deeper_depth_does(tmp_path):
  """The same real job with its depth at auto (the default): the sizer climbs past the depth
  that keeps the wire busy on each mid-step wait, so the advice says what that deeper depth does
  rather than that no depth beyond it can hide the wire."""
  run_wire_bound_job(tmp_path)
  orchestrator_steps = records_lib.read([str(tmp_path)]).steps[record_lib.ORCHESTRATOR]
  assert orchestrator_steps["sizing"].notna().all()  # its depth sized each step
  wire = next(a for a in report_json(tmp_path)["advice"] if a["kind"] == advice_lib.WIRE)
  assert wire["why"].startswith("the wire is the bound: a micro-batch takes ")
  assert wire["why"].endswith("keeps the wire busy, and the deeper depths auto climbs to ride "
                              "out its spikes but cannot hide it"), wire["why"]
  assert "no depth beyond" not in wire["why"]
  assert max(orchestrator_steps["depth"]) > int(wire["why"].split(" so depth ")[1].split()[0])


def write_minority_job(folder, steps=7, slow=(2, 4, 6)):
  """A trainer's record from the telemetry core, fed spans built here: steps of 2 fwd_bwd (1.0 s
  each) and an update (0.2 s); each micro-batch received in 0.4 s and placed in 0.1 s beside the
  computation before it, except in the `slow` steps, whose receives take 1.5 s (longer than the
  compute they hide behind): there the second fwd_bwd waits 0.6 s for its input. (A real job
  cannot hold such a minority deterministically: its wire is either slower than its compute in
  every step or in none.)"""
  tel = process.Telemetry(process.Settings(
      host="tunix", metrics_dir=str(folder), log_every=0,
      shaping=(("max_device_batches", 1), ("max_host_batches", 1))))
  tel.trainer(lambda: (1, 1))
  t = 0.0
  for step in range(steps):
    receive = 1.5 if step in slow else 0.4
    spans = []
    for i in range(2):
      start = t
      spans += [Span(tracks.TRAINER_RECEIVE, "stage_batch", start, start + receive,
                     (("bytes", 64 * MIB), ("transport", "side"))),
                Span(tracks.TRAINER_H2D, "s-m", start + receive, start + receive + 0.1,
                     (("bytes", 64 * MIB), ("lane", "staging")))]
      if i == 1:
        t = max(t, start + receive + 0.1 - 1.0)  # the input late: the device waits
      spans.append(compute("fwd_bwd", t, t + 1.0))
      t += 1.0
    spans.append(compute("update", t, t + 0.2))
    t += 0.2
    for span in spans:
      tel.recorder.add(span.track, span.name, span.start, span.end, **dict(span.args))
  tel.close()


def test_a_job_bound_by_the_wire_in_3_of_7_steps_is_not_told_nothing_to_change(tmp_path):
  write_minority_job(tmp_path)
  summary = report_json(tmp_path)
  # Counts over every step but the first (its compile, counted apart); the rule judges the 6
  # after it.
  assert summary["trainer"]["bound_by"] == {"compute": 3, "wire": 3, "shared cores": 0}
  assert summary["trainer"]["first_steps"] == 1
  (wire,) = summary["advice"]
  assert wire["kind"] == advice_lib.WIRE and wire["recommended"]
  assert (wire["figure"]["steps"], wire["figure"]["of"]) == (3, 6)
  settings = advice_lib.Settings(host="tunix", depth=2, prestage=False, max_device_batches=1,
                                 max_host_batches=1)
  before, after = simulated(tmp_path, settings), simulated(tmp_path, settings, 0.5)
  assert wire["prediction"] == {"before_s": pytest.approx(before), "after_s": pytest.approx(after)}
  assert after < before * (1 - check_lib.MIN_GAIN)
  last = report_text(tmp_path).splitlines()[-1]
  assert last.startswith("recommendation: compress the payload") and "nothing to change" not in last
  assert f"simulate predicts {before:.2f} s -> {after:.2f} s a step" in last


def test_a_change_the_simulator_predicts_no_gain_from_is_not_recommended(tmp_path):
  """A job whose input was never late, prestaging at depth 2: simulate predicts a halved wire
  shortens nothing, so the report turns that change down, and says there is nothing to change."""
  write_minority_job(tmp_path, slow=())
  summary = report_json(tmp_path)
  assert summary["advice"] == [] and summary["recommendations"] == []
  settings = advice_lib.Settings(host="tunix", depth=2, prestage=True, max_device_batches=1,
                                 max_host_batches=1)
  wire = advice_lib.Advice(advice_lib.WIRE, "compress", advice_lib.Figure("f", 0.0, 0, 6), "c",
                           "w", advice_lib.Change(wire=0.5))
  trainer = records_lib.read([str(tmp_path)]).steps[record_lib.TRAINER]
  (prediction,) = check_lib.predict(trainer, settings, [wire])
  assert not prediction.helps and prediction.after_s == pytest.approx(prediction.before_s)
  entry = {"line": f"{wire.line()}; {prediction}", "recommended": prediction.helps}
  assert report_cmd.advice_lines([entry]) == [
      f"not recommended: {entry['line']} (no shorter)",
      "recommendation: nothing to change: simulate predicts none of the changes above shortens "
      "the step"]
