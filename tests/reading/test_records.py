"""The record reader at the edges: numbers a float cannot hold or a column cannot print, files
that are not records (a named pipe, a line without end), a record still being written, the
version before this one, and a long record read in blocks. Real records: the telemetry core's
(tests/cli/test_report.py's job), edited as a hand would.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from tests.cli.test_report import write_trainer_job
from tests.core.test_telemetry import compute
from tunix_stage_plugin.core.telemetry import process
from tunix_stage_plugin.core.telemetry import record as record_lib
from tunix_stage_plugin.reading import records as records_lib
from tunix_stage_plugin.reading import runs as runs_lib


def written(path):
  """The records of `path` as their lines hold them (plain JSON, no reader)."""
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def report(*argv):
  return subprocess.run([sys.executable, "-m", "tunix_stage_plugin", "report", *argv],
                        capture_output=True, text=True, timeout=60)


def refused_line(proc):
  assert proc.returncode == 2 and proc.stdout == ""
  (line,) = proc.stderr.strip().splitlines()
  assert line.startswith("tunix-stage report: error: ") and "Traceback" not in proc.stderr
  return line


def edited(tmp_path, edit):
  """A real trainer record of 2 steps whose second line `edit` changed (as text)."""
  (path,) = write_trainer_job(tmp_path, steps=2)
  with open(path, encoding="utf-8") as f:
    first, second = f.read().splitlines()
  with open(path, "w", encoding="utf-8") as f:
    f.write(first + "\n" + edit(second) + "\n")
  return path


@pytest.mark.parametrize("field, text, accepted", [
    ("receive.bytes", "1" + "0" * 400, records_lib.COUNT),  # 10**400: no float holds it
    ("place.count", str(2**53 + 1), records_lib.COUNT),
    ("compute_s", "1e400", records_lib.NUMBER),  # read as infinity
    ("other_s", "1e308", records_lib.NUMBER),  # a float, but a 309-digit column
    ("input_wait_s.mid_step", "-0.5", records_lib.NUMBER),
    ("step_s", "NaN", records_lib.NUMBER),
])
def test_a_number_out_of_range_is_one_line_naming_its_field(tmp_path, field, text, accepted):
  *outer, key = field.split(".")

  def edit(line):
    rec = json.loads(line)
    place = rec
    for part in outer:
      place = place[part]
    place[key] = "@"
    return json.dumps(rec).replace('"@"', text)

  path = edited(tmp_path, edit)
  line = refused_line(report(path))
  assert f"{path}:2 {field}=" in line and line.endswith(f"accepted: {accepted}")


def test_the_bounds_are_plausible_and_print_in_a_column():
  assert records_lib.NUMBER == "a number >= 0 and <= 1e+12"
  assert records_lib.COUNT == f"an integer >= 0 and <= {2**53}"
  assert len(f"{records_lib.MAX_NUMBER:.2f}") == 16


def test_a_named_pipe_in_a_folder_is_skipped_never_opened(tmp_path):
  write_trainer_job(tmp_path, steps=2)
  pipe = tmp_path / "p.jsonl"
  os.mkfifo(pipe)  # nothing ever writes to it: an open for reading would wait for ever
  proc = report(str(tmp_path))
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.splitlines()[0] == (f"note: {pipe}: skipped: a named pipe, not a record "
                                        "file")
  assert "(tunix, 2 steps)" in proc.stdout
  notes = []
  assert str(pipe) not in [p for p, _ in records_lib.files([str(tmp_path)], notes)]
  assert notes == [f"{pipe}: skipped: a named pipe, not a record file"]
  # Given by name, it is refused (and not opened either).
  line = refused_line(report(str(pipe)))
  assert line.endswith(f"{pipe} is invalid: not a regular file (a named pipe); accepted: "
                       f"{records_lib.PATHS_ACCEPTED}")


def test_a_record_still_being_written_is_not_called_killed(tmp_path):
  (path,) = write_trainer_job(tmp_path, steps=2)
  with open(path, "a", encoding="utf-8") as f:
    f.write('{"schema": "tunix-stage-metrics", "ver')
  found = records_lib.read([path])
  (note,) = found.notes
  assert len(found.steps["trainer"]) == 2
  assert note.startswith(f"{path}: its last line is still being written (the file changed ")
  assert "killed" not in note
  old = time.time() - 2 * records_lib.WRITING_S
  os.utime(path, (old, old))
  (note,) = records_lib.read([path]).notes
  assert note == (f"{path}: its last line is cut short (the process was killed while writing "
                  "it); read the 2 whole record(s) before it")


def test_a_line_longer_than_a_record_s_is_refused_without_reading_it_whole(tmp_path):
  (path,) = write_trainer_job(tmp_path, steps=1)
  with open(path, "a", encoding="utf-8") as f:
    f.write(" " * (records_lib.MAX_LINE + 10) + "\n")
  line = refused_line(report(path))
  assert f"{path}:2 is invalid: a line of more than {records_lib.MAX_LINE} bytes" in line


def test_version_1_records_still_read_and_another_version_is_refused(tmp_path):
  (path,) = write_trainer_job(tmp_path, steps=2)
  records = written(path)
  assert {r["version"] for r in records} == {record_lib.VERSION} == {2}
  assert all(set(r["run"]) == {"id", "started"} for r in records)
  steps = records_lib.read([path]).steps["trainer"]
  assert steps["run"].tolist() == [records[0]["run"]["id"]] * 2
  old = tmp_path / "old" / "trainer-vm-1.jsonl"
  old.parent.mkdir()
  old.write_text("".join(json.dumps({**{k: v for k, v in r.items() if k != "run"},
                                     "version": 1}) + "\n" for r in records))
  read_old = records_lib.read([str(old)])
  assert read_old.notes == [] and read_old.steps["trainer"]["step"].tolist() == [0, 1]
  assert read_old.steps["trainer"]["run"].isna().all()
  # A version-1 record that writes `run` must write it whole, as version 2 does.
  old.write_text(json.dumps({**records[0], "version": 1, "run": None}) + "\n")
  with pytest.raises(records_lib.RecordError, match=r":1 run='null' is invalid"):
    records_lib.read([str(old)])
  # A version-2 record without its run is not one.
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps({k: v for k, v in records[0].items() if k != "run"}) + "\n")
  with pytest.raises(records_lib.RecordError, match=r"a trainer record without \['run'\]"):
    records_lib.read([str(bad)])
  for version in (3, 0, True, "2", [2], {}):  # a list or an object: one line, not a TypeError
    bad.write_text(json.dumps({**records[0], "version": version}) + "\n")
    with pytest.raises(records_lib.RecordError,
                       match=f"schema version {re.escape(repr(version))} is not one"):
      records_lib.read([str(bad)])


def test_a_long_record_is_read_in_blocks_of_whole_lines(tmp_path, monkeypatch):
  """A record longer than a block is read a block of whole lines at a time: every step once, in
  order, the line a block boundary falls in read whole, and a wrong line past the first block
  named by its number in the file."""
  (path,) = write_trainer_job(tmp_path, steps=9)
  lines = open(path, encoding="utf-8").read().splitlines(keepends=True)
  monkeypatch.setattr(records_lib, "BLOCK", len(lines[0]) * 2 + 7)  # mid-line, about 2 a block
  steps = records_lib.read([path]).steps["trainer"]
  assert steps["step"].tolist() == list(range(9))
  assert steps["run"].nunique() == 1 and steps["compute_s"].notna().all()
  rec = json.loads(lines[7])
  rec["compute_s"] = "x"
  lines[7] = json.dumps(rec) + "\n"
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(lines)
  with pytest.raises(records_lib.RecordError, match=f"{re.escape(path)}:8 compute_s="):
    records_lib.read([path])


def test_each_run_of_a_process_has_its_id_its_start_and_its_own_file(tmp_path):
  """A process's telemetry names its run in every record; a new run in it (the bench's modes, an
  embedded trainer's next orchestrator) gets a new id and start, and a file of its own."""
  tel = process.Telemetry(process.Settings(host="test", metrics_dir=str(tmp_path), log_every=0))
  tel.trainer()
  first = dict(tel.run)
  for span in (compute("fwd_bwd", 0.0, 1.0), compute("update", 1.0, 1.1)):
    tel.recorder.add(span.track, span.name, span.start, span.end, **dict(span.args))
  tel.restart()
  assert tel.run["id"] != first["id"] and tel.run["started"] >= first["started"]
  for span in (compute("fwd_bwd", 2.0, 3.0), compute("update", 3.0, 3.1)):
    tel.recorder.add(span.track, span.name, span.start, span.end, **dict(span.args))
  tel.close()
  notes = []
  paths = [p for p, _ in records_lib.files([str(tmp_path)], notes)]
  assert notes == [] and sorted(os.path.basename(p) for p in paths) == sorted(
      record_lib.file_name("trainer", run["id"]) for run in (first, tel.run))
  runs = [records_lib.read([p]).steps["trainer"] for p in paths]
  assert sorted(r["run"][0] for r in runs) == sorted([first["id"], tel.run["id"]])
  assert all(r["step"].tolist() == [0] for r in runs)  # each run from step 0


def test_a_line_of_another_role_is_checked_for_its_own_role(tmp_path):
  """A file's lines are read as its first line's role: an orchestrator line after a trainer's,
  with the trainer's `staged` object where a count belongs, is checked as an orchestrator's and
  refused."""
  (path,) = write_trainer_job(tmp_path, steps=1)
  trainer = json.loads(open(path, encoding="utf-8").read())
  orchestrator = {**trainer, "role": "orchestrator", "step_s": None, "microbatches": 1,
                  "depth": 1, "inline": 0, "prestaged": 0, "peak_staged": 1,
                  "fallbacks": {"count": 0, "by_kind": {}}, "sent": {},
                  "stage_calls": {"count": 0, "seconds": 0, "median_s": None, "max_s": None}}
  with open(path, "a", encoding="utf-8") as f:
    f.write(json.dumps(orchestrator) + "\n")
  with pytest.raises(records_lib.RecordError, match=r":2 staged=.* is invalid; accepted: an "
                     "integer >= 0"):
    records_lib.read([path])
  # Of its own shape, it is read, as its own role's step.
  with open(path, "w", encoding="utf-8") as f:
    f.write(json.dumps(trainer) + "\n" + json.dumps({**orchestrator, "staged": 1}) + "\n")
  found = records_lib.read([path]).steps
  assert len(found["trainer"]) == 1 and found["orchestrator"]["staged"].tolist() == [1]


@pytest.mark.parametrize("at", [1e12, 0.5])
def test_a_time_at_the_edge_of_its_range_is_reported(tmp_path, at):
  def edit(line):
    rec = json.loads(line)
    rec["time"] = rec["run"]["started"] = at
    return json.dumps(rec)

  (path,) = write_trainer_job(tmp_path, steps=2)
  with open(path, encoding="utf-8") as f:
    lines = [edit(line) for line in f.read().splitlines()]
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  proc = report(path)
  assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
  assert proc.stdout.startswith("run: started " + runs_lib.when(at))
