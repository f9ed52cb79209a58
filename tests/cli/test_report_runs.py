"""`tunix-stage report` and `simulate` on records of several runs: two real embedded jobs (a
trainer process and its orchestrator each, over gRPC on 127.0.0.1, the job's depth 2 then 1)
writing into one folder, as a user who reuses TUNIX_STAGE_METRICS gets; and how runs are told
apart and paired (reading/runs.py), on records written by the record's own Writer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tunix_stage_plugin.core.telemetry import record as record_lib
from tunix_stage_plugin.reading import report as report_cmd
from tunix_stage_plugin.reading import runs as runs_lib
from tunix_stage_plugin.lab.embedded import process as process_lib

ORCH = [sys.executable, "-m", "tunix_stage_plugin.lab.embedded.orchestrator_main"]
DEPTHS = (2, 1)


def tool(*argv, check=True):
  proc = subprocess.run([sys.executable, "-m", "tunix_stage_plugin", *argv],
                        capture_output=True, text=True, timeout=120)
  if check:
    assert proc.returncode == 0, proc.stderr
  return proc


@pytest.fixture(name="two_jobs", scope="module")
def fixture_two_jobs(tmp_path_factory):
  """One folder holding two real jobs' records, one after the other: 3 steps of 2 micro-batches
  each, staged at depth 2, then at depth 1 (each job its own trainer and orchestrator)."""
  folder = tmp_path_factory.mktemp("jobs") / "metrics"
  telemetry = ["--stage_metrics", str(folder), "--stage_log_every", "0"]
  for depth in DEPTHS:
    with process_lib.TrainerProcess(extra_args=telemetry) as trainer:
      proc = subprocess.run([*ORCH, "--trainer", trainer.address, "--tiny", "--steps", "3",
                             "--microbatches", "2", "--stage_train_batches", "stage",
                             "--max_staged_batches", str(depth), *telemetry],
                            capture_output=True, text=True, timeout=120)
      assert proc.returncode == 0, proc.stderr
  return folder


def test_two_jobs_in_one_folder_are_reported_run_by_run(two_jobs):
  found, notes = runs_lib.runs([str(two_jobs)])
  assert notes == [] and len(found) == 2
  for run, depth in zip(found, DEPTHS):
    assert [p.role for p in run.processes] == ["trainer", "orchestrator"]
    assert run.trainer_steps["step"].tolist() == run.orchestrator_steps["step"].tolist() == \
        [0, 1, 2]
    assert set(run.orchestrator_steps["depth"]) == {depth}
    assert f"max_staged_batches={depth}," in run.label
  assert found[0].started < found[1].started
  assert {p.pid for p in found[0].processes}.isdisjoint(p.pid for p in found[1].processes)
  out = tool("report", str(two_jobs)).stdout.splitlines()
  assert out[0].startswith("2 runs (jobs) in these records, each reported apart")
  heads = [line for line in out if line.startswith("run ")]
  assert heads == [f"run {n} of 2: {r.label}" for n, r in enumerate(found, start=1)]
  # Each its own tables, overall and recommendation: never one median over the two.
  assert sum(line.startswith("overall") for line in out) == 2
  assert sum(line.startswith("recommendation: ") for line in out) == 2
  assert sum(line.startswith("trainer ") and "(embedded, 3 steps)" in line for line in out) == 2
  data = json.loads(tool("report", str(two_jobs), "--json").stdout)
  assert [r["label"] for r in data["runs"]] == [r.label for r in found]
  # Depth 1 stages 1 of each step's 2 micro-batches; depth 2, after the first, both.
  staged = [r["summary"]["orchestrator"]["staged"] for r in data["runs"]]
  assert staged[0] > staged[1] == 3


def test_simulate_refuses_several_runs_naming_each_and_takes_one_run_s_file(two_jobs):
  proc = tool("simulate", str(two_jobs), check=False)
  assert proc.returncode == 2 and proc.stdout == ""
  (line,) = proc.stderr.strip().splitlines()
  found, _ = runs_lib.runs([str(two_jobs)])
  assert "it holds 2 runs" in line and "give one run's files" in line
  for run in found:
    assert all(f in line for f in run.files)
  trainer_file = next(f for f in found[1].files if "/trainer-" in f)
  out = tool("simulate", trainer_file).stdout
  assert "depth2_prestage" in out


def test_two_paths_each_holding_one_run_are_a_comparison_s_pair(two_jobs, tmp_path):
  found, _ = runs_lib.runs([str(two_jobs)])
  apart = []
  for n, run in enumerate(found):
    folder = tmp_path / f"job{n}"
    folder.mkdir()
    for f in run.files:
      shutil.copy(f, folder)
    apart.append(str(folder))
  pair_found, _ = runs_lib.runs(apart[::-1])
  first, second = report_cmd.comparable(apart[::-1], pair_found)
  assert first.sources == (apart[1],) and second.sources == (apart[0],)
  # One path: no pair; a job's two files given apart are one run, not two to compare.
  assert report_cmd.comparable([str(two_jobs)], found) is None
  files = list(found[0].files)
  one, _ = runs_lib.runs(files)
  assert len(one) == 1 and report_cmd.comparable(files, one) is None
  (alone,) = runs_lib.runs([apart[0]])[0]
  assert tool("report", apart[0]).stdout.splitlines()[0] == f"run: {alone.label}"


def test_version_1_records_are_runs_by_process_and_time(two_jobs, tmp_path):
  """Records as version 1 wrote them (no run): each process is its run, and a trainer and an
  orchestrator are one job's when their records' times overlap."""
  found, _ = runs_lib.runs([str(two_jobs)])
  for run in found:
    for f in run.files:
      with open(f, encoding="utf-8") as src, \
          open(tmp_path / os.path.basename(f), "w", encoding="utf-8") as dst:
        for line in src:
          rec = json.loads(line)
          del rec["run"]
          rec["version"] = 1
          dst.write(json.dumps(rec) + "\n")
  old, notes = runs_lib.runs([str(tmp_path)])
  assert notes == [] and [[p.name for p in r.processes] for r in old] == \
      [[p.name for p in r.processes] for r in found]
  assert all(p.run is None for r in old for p in r.processes)
  assert old[0].label.startswith("about started ")
  assert [len(r.trainer_steps) for r in old] == [3, 3]


def _write(folder, role, host, times, pid, run=True, started=None, step_s=1.0):
  """A process's records at `times` (Unix seconds), each step `step_s` long, through the record's
  own Writer; its run started at `started` (a second before its first record unless given)."""
  figures = {"trainer": json.loads(json.dumps(TRAINER)), "orchestrator": ORCHESTRATOR}[role]
  figures = {**figures, "step_s": step_s}
  ident = {"id": f"{role[0]}{pid}", "started": times[0] - 1.0 if started is None else started}
  writer = record_lib.Writer(str(folder), role, ident["id"])
  for step, t in enumerate(times):
    rec = record_lib.make(role, host, {**figures, "step": step}, {}, ident)
    rec["time"], rec["process"]["pid"] = t, pid
    if not run:
      del rec["run"]
      rec["version"] = 1
    writer.write(rec)
  writer.close()


TRAINER = {"host_step": None, "step_s": 1.0, "compute_s": 1.0,
           "input_wait_s": {"mid_step": 0.0, "boundary": 0.0}, "other_s": 0.0,
           "microbatches": 1, "compute": {"fwd_bwd_median_s": 1.0, "update_s": 0.0,
                                          "alone_s": None, "beside_transfer": 0,
                                          "slowdown_s": None},
           "receive": {"calls": 0, "bytes": 0, "seconds": 0.0, "by_transport": {}},
           "place": {"count": 1, "seconds": 0.0, "bytes": 0, "staged": 1, "inline": 0},
           "pool": {"waits": 0, "wait_s": 0.0, "over_bound": 0},
           "staged": {"peak_device": 1, "peak_host": 1}, "bound_by": "compute"}
ORCHESTRATOR = {"step_s": 1.0, "microbatches": 1, "depth": 1, "staged": 1, "inline": 0,
                "prestaged": 0, "peak_staged": 1, "fallbacks": {"count": 0, "by_kind": {}},
                "sent": {}, "stage_calls": {"count": 1, "seconds": 0.1, "median_s": 0.1,
                                            "max_s": 0.1}}


def test_runs_pair_by_overlapping_time_on_hosts_that_meet(tmp_path):
  # A tunix orchestrator with a MaxText trainer (behind tunix's worker), overlapping: one job.
  _write(tmp_path, "trainer", "maxtext", [100.0, 101.0, 102.0], pid=1)
  _write(tmp_path, "orchestrator", "tunix", [100.5, 101.5, 102.5], pid=2)
  # An embedded job at the same time: another job (another host).
  _write(tmp_path, "trainer", "embedded", [100.0, 101.0], pid=3)
  # The next tunix job, started after the first ended: another run.
  _write(tmp_path, "trainer", "tunix", [200.0, 201.0], pid=4)
  _write(tmp_path, "orchestrator", "tunix", [200.2, 201.2], pid=5)
  # A trainer started while the first job ran, its steps (with its orchestrator's) long after:
  # its steps, not its start, pair it.
  _write(tmp_path, "trainer", "tunix", [300.0, 301.0], pid=7, started=90.0)
  _write(tmp_path, "orchestrator", "tunix", [300.5, 301.5], pid=8)
  found, _ = runs_lib.runs([str(tmp_path)])
  assert sorted([p.pid for p in r.processes] for r in found) == [[1, 2], [3], [4, 5], [7, 8]]
  assert found[-1].started == 90.0 and runs_lib.when(90.0) in found[-1].label
  # A job's trainer restarted (a new run of its process) while the orchestrator ran: one job.
  again = tmp_path / "again"
  _write(again, "trainer", "tunix", [100.0, 101.0], pid=1)
  _write(again, "trainer", "tunix", [103.0, 104.0], pid=6)
  _write(again, "orchestrator", "tunix", [100.5, 104.5], pid=2)
  (run,), _ = runs_lib.runs([str(again)])
  assert [p.pid for p in run.processes] == [1, 6, 2] and len(run.trainer_steps) == 4


def test_two_jobs_one_after_the_other_are_two_however_close(tmp_path):
  """Steps of 25 ms, the second job 1.4 s after the first (two bench runs back to back, as the
  tunix-marked report A B test makes them): each trainer step joins the orchestrator whose steps
  it falls among, never one run of four processes."""
  first = [100.0 + 0.025 * k for k in range(6)]
  second = [t + 1.4 for t in first]
  _write(tmp_path, "trainer", "tunix", [t - 0.004 for t in first], pid=1, step_s=0.025)
  _write(tmp_path, "orchestrator", "tunix", first, pid=9, step_s=0.025)
  _write(tmp_path, "trainer", "tunix", [t + 0.002 for t in second], pid=2, step_s=0.025)
  ident = {"id": "o9b", "started": second[0] - 0.1}  # the same orchestrator process, a new run
  writer = record_lib.Writer(str(tmp_path), "orchestrator", ident["id"])
  for step, t in enumerate(second):
    rec = record_lib.make("orchestrator", "tunix", {**ORCHESTRATOR, "step_s": 0.025,
                                                    "step": step}, {}, ident)
    rec["time"], rec["process"]["pid"] = t, 9
    writer.write(rec)
  writer.close()
  found, _ = runs_lib.runs([str(tmp_path)])
  assert [[p.pid for p in r.processes] for r in found] == [[1, 9], [2, 9]]
  assert [(len(r.trainer_steps), len(r.orchestrator_steps)) for r in found] == [(6, 6), (6, 6)]


def test_a_trainer_that_served_one_orchestrator_after_another_is_split_between_the_jobs(
    tmp_path):
  _write(tmp_path, "trainer", "tunix", [100.0, 101.0, 102.0, 110.0, 111.0], pid=1)
  _write(tmp_path, "orchestrator", "tunix", [100.1, 101.1, 102.1], pid=2)
  _write(tmp_path, "orchestrator", "tunix", [110.1, 111.1], pid=3)
  found, _ = runs_lib.runs([str(tmp_path)])
  assert [[p.pid for p in r.processes] for r in found] == [[1, 2], [1, 3]]
  assert [run.trainer_steps["step"].tolist() for run in found] == [[0, 1, 2], [3, 4]]
  # A trainer step near no orchestrator's steps is a run of the trainer alone.
  _write(tmp_path / "late", "trainer", "tunix", [100.0, 200.0], pid=4)
  _write(tmp_path / "late", "orchestrator", "tunix", [100.1], pid=5)
  found, _ = runs_lib.runs([str(tmp_path / "late")])
  assert [[p.pid for p in r.processes] for r in found] == [[4, 5], [4]]


def _numbered(folder, role, pid, times, host_steps, step_s):
  """A tunix process's records at `times`, each step `step_s` long and numbered `host_steps`
  (tunix's train step), through the record's own Writer."""
  figures = {"trainer": TRAINER, "orchestrator": ORCHESTRATOR}[role]
  ident = {"id": f"{role[0]}{pid}", "started": times[0] - 1.0}
  writer = record_lib.Writer(str(folder), role, ident["id"])
  for step, (t, host_step) in enumerate(zip(times, host_steps)):
    rec = record_lib.make(role, "tunix", {**figures, "step_s": step_s, "step": step,
                                          "host_step": host_step}, {}, ident)
    rec["time"], rec["process"]["pid"] = t, pid
    writer.write(rec)
  writer.close()


def test_tunix_s_train_step_pairs_a_trainer_step_with_the_orchestrator_that_ran_it(tmp_path):
  """A staged job, then at once an inline one whose orchestrator ran without the plugin (as the
  tunix-marked observability test runs them): the trainer's steps 2 and 3 fall within a second
  of the first orchestrator's, but tunix's train step (`host_step`, on both sides) says the
  first orchestrator ran steps 1 and 2 only."""
  _numbered(tmp_path, "trainer", 1, [100.0, 100.25, 101.3, 102.5], [1, 2, 3, 4], 0.25)
  _numbered(tmp_path, "orchestrator", 2, [100.01, 100.26], [1, 2], 0.25)
  found, _ = runs_lib.runs([str(tmp_path)])
  assert [[p.pid for p in r.processes] for r in found] == [[1, 2], [1]]
  assert [run.trainer_steps["host_step"].astype(int).tolist() for run in found] == \
      [[1, 2], [3, 4]]


def test_a_trainer_step_that_ran_the_orchestrator_s_step_joins_it_however_late_its_record(
    tmp_path):
  """On a busy machine a trainer's record of a step (made when its update's computation ends)
  may come more than SLACK_S after its orchestrator's step ended: where both number the step
  (tunix's train step), it joins the orchestrator that ran it within that orchestrator's longest
  step; an unnumbered one so late is a run of its own."""
  _numbered(tmp_path, "orchestrator", 2, [100.0, 103.0, 106.0], [1, 2, 3], 3.0)
  _numbered(tmp_path, "trainer", 1, [100.05, 103.05, 108.5], [1, 2, 3], 3.0)  # 2.5 s late
  (run,), _ = runs_lib.runs([str(tmp_path)])
  assert [p.pid for p in run.processes] == [1, 2] and len(run.trainer_steps) == 3
  late = tmp_path / "unnumbered"
  _numbered(late, "orchestrator", 2, [100.0, 103.0, 106.0], [None] * 3, 3.0)
  _numbered(late, "trainer", 1, [100.05, 103.05, 108.5], [None] * 3, 3.0)
  found, _ = runs_lib.runs([str(late)])
  assert [[p.pid for p in r.processes] for r in found] == [[1, 2], [1]]
