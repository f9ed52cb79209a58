"""A run's steps as columns (core/telemetry/steps.py): each column is its record field over the steps,
report A B reads each scalar as scalars.py reads it from a record, a run keeps its columns and
reads again the records it shows, and the record read alike with orjson or without. Real
records: the telemetry core's trainer (tests/cli/test_report.py's job) and orchestrator records
made by record.make, as the simulator's are.
"""

from __future__ import annotations

import json
import random

import pytest

from tests.cli.test_report import write_trainer_job
from tunix_stage_plugin.cli import report_compare
from tunix_stage_plugin.core.telemetry import record as record_lib
from tunix_stage_plugin.core.telemetry import runs as runs_lib
from tunix_stage_plugin.core.telemetry import scalars
from tunix_stage_plugin.core.telemetry import steps as steps_lib

MIB = 1 << 20


def trainer_records(folder):
  """A real trainer's 6 steps, staged then inline (a pool wait in each)."""
  (path,) = write_trainer_job(folder, steps=6, pool_waits=1, inline_from=3)
  return list(record_lib.Reader(path))


def orchestrator_records(steps=6):
  """An orchestrator's steps as record.make writes them: some refused, one with a second
  transport, the first with no step before it."""
  rng = random.Random(7)
  run = record_lib.new_run()
  out = []
  for step in range(steps):
    sent = {"side": {"calls": 2, "bytes": 2 * MIB, "seconds": rng.uniform(0.1, 0.2)}}
    if step == 2:
      sent["grpc"] = {"calls": 1, "bytes": MIB, "seconds": 0.3, "gib_s": 0.5}
    refused = step % 2
    figures = {"step": step, "host_step": step + 1, "step_s": None if step == 0 else 2.0,
               "microbatches": 2, "depth": 1, "staged": 2 - refused, "inline": refused,
               "prestaged": 0, "peak_staged": 1,
               "fallbacks": {"count": refused, "by_kind": {"refused": 1} if refused else {}},
               "sent": sent, "stage_calls": {"count": 2, "seconds": 0.4, "median_s": 0.2,
                                             "max_s": None if step == 0 else 0.25}}
    out.append(record_lib.make(record_lib.ORCHESTRATOR, "tunix", figures, {}, run))
  return out


def field(rec, path):
  for key in path.split("."):
    rec = rec.get(key) if rec is not None else None
  return rec


def test_each_column_is_its_record_field_over_the_steps(tmp_path):
  for records in (trainer_records(tmp_path), orchestrator_records()):
    steps = steps_lib.Steps.of(records[0]["role"], records)
    assert len(steps) == len(records) and steps.last is records[-1]
    for name in steps.columns:
      assert list(steps.values(name)) == [field(r, name) for r in records], name
  trainer = steps_lib.Steps.of(record_lib.TRAINER, trainer_records(tmp_path / "again"))
  assert set(trainer.values("bound_by")) <= {"compute", "wire", "shared cores"}
  assert trainer.values("step_s")[0] is None and None not in trainer.values("step_s")[1:]
  orchestrator = orchestrator_records()
  steps = steps_lib.Steps.of(record_lib.ORCHESTRATOR, orchestrator)
  # An object of any fields: a column per field seen, 0 in a step without it.
  sent = steps.family("sent")
  assert list(sent) == ["side", "grpc"] and list(sent["grpc"]["calls"]) == [0, 0, 1, 0, 0, 0]
  assert list(steps.family("fallbacks.by_kind")["refused"]) == [0, 1, 0, 1, 0, 1]


def test_steps_taken_and_joined_are_those_of_their_records(tmp_path):
  records = orchestrator_records()
  whole = steps_lib.Steps.of(record_lib.ORCHESTRATOR, records)
  parts = [steps_lib.Steps.of(record_lib.ORCHESTRATOR, records[:2]),
           steps_lib.Steps.of(record_lib.ORCHESTRATOR, records[2:])]  # only the second has grpc
  joined = steps_lib.Steps.joined(record_lib.ORCHESTRATOR, parts)
  taken = whole.take([1, 3, 5])
  for name in whole.columns:
    assert list(joined.values(name)) == list(whole.values(name)), name
    assert list(taken.values(name)) == [field(records[i], name) for i in (1, 3, 5)], name
  assert {k: {p: list(a) for p, a in c.items()} for k, c in joined.family("sent").items()} == \
      {k: {p: list(a) for p, a in c.items()} for k, c in whole.family("sent").items()}
  assert joined.last is records[-1] and taken.last is None  # a part's last: runs.py says it
  trainer = trainer_records(tmp_path)
  texts = steps_lib.Steps.joined(record_lib.TRAINER, [
      steps_lib.Steps.of(record_lib.TRAINER, trainer[3:]),
      steps_lib.Steps.of(record_lib.TRAINER, trainer[:3])])
  assert texts.values("bound_by") == [r["bound_by"] for r in trainer[3:] + trainer[:3]]


def test_report_a_b_reads_each_scalar_as_scalars_reads_it_from_a_record(tmp_path):
  """report_compare.FIGURES reads the columns; scalars.py (the one table of the names) reads a
  record: the same values, step by step."""
  tables = {record_lib.TRAINER: scalars.TRAINER, record_lib.ORCHESTRATOR: scalars.ORCHESTRATOR}
  records = {record_lib.TRAINER: trainer_records(tmp_path),
             record_lib.ORCHESTRATOR: orchestrator_records()}
  named = set()
  for side, name, read in report_compare.FIGURES:
    steps = steps_lib.Steps.of(side, records[side])
    got = list(read(steps, list(range(len(steps)))))
    if name == "input_wait_s":
      continue
    assert got == [tables[side][name](r) for r in records[side]], name
    named.add((side, name))
  assert named == {(side, name) for side, table in tables.items() for name in table
                   if not name.startswith("bound_by_")}


def test_a_run_keeps_its_steps_and_reads_again_the_records_it_shows(tmp_path):
  records = trainer_records(tmp_path)
  (run,), _ = runs_lib.runs([str(tmp_path)])
  (process,) = run.processes
  assert len(process.steps) == len(run.trainer_steps) == 6
  assert run.trainer == records and process.records(2) == records[-2:]
  assert process.records(0) == [] and process.records(100) == records
  assert run.records(record_lib.TRAINER, 1) == records[-1:] and run.orchestrator == []


# (field, its text in the line, whether the record is refused): json reads each, orjson none.
EDITS = [("step_s", "NaN", True), ("receive.bytes", str(2**64), True),
         ("place.count", "1" + "0" * 400, True), ("bound_by", '"\\ud800"', False)]


def outcome(path):
  """The records read, or the line that refuses them."""
  try:
    return list(record_lib.Reader(path))
  except record_lib.RecordError as e:
    return str(e)


@pytest.mark.parametrize("fast", [False, True], ids=["json", "orjson"])
def test_the_record_is_read_alike_with_orjson_or_without(tmp_path, monkeypatch, fast):
  """orjson (the `fast` extra) where installed: the same records, and the same line for a record
  that is wrong (json's value named, where orjson reads it otherwise or not at all)."""
  orjson = pytest.importorskip("orjson") if fast else None
  (path,) = write_trainer_job(tmp_path, steps=3)
  with open(path, encoding="utf-8") as f:
    lines = f.read().splitlines()
  for name, text, refused in EDITS:
    *outer, key = name.split(".")
    rec = json.loads(lines[1])
    place = rec
    for part in outer:
      place = place[part]
    place[key] = "@"
    bad = tmp_path / f"bad-{key}{record_lib.SUFFIX}"
    bad.write_text(lines[0] + "\n" + json.dumps(rec).replace('"@"', text) + "\n",
                   encoding="utf-8")
    read = {}
    for reader in (None, orjson):
      monkeypatch.setattr(record_lib, "orjson", reader)
      read[reader] = outcome(str(bad)), outcome(path)
    assert read[orjson] == read[None], name
    said, good = read[orjson]
    assert good == [json.loads(line) for line in lines]
    assert isinstance(said, str) == refused and (not refused or f"{bad}:2 {name}" in said), said


def test_a_record_changed_after_it_was_read_is_one_line(tmp_path):
  """The rows a table shows are read again by their line's offset: a file rewritten in between
  is said in one line, never a traceback."""
  trainer_records(tmp_path)
  (run,), _ = runs_lib.runs([str(tmp_path)])
  (path,) = run.files
  with open(path, "r+", encoding="utf-8") as f:
    f.seek(0)
    f.write("x" * 40)
  with pytest.raises(record_lib.RecordError, match="changed while it was read"):
    run.records(record_lib.TRAINER)


def test_a_field_added_to_the_table_is_a_column_and_words_are_not(monkeypatch):
  """A field record.SHAPES gains (an object that may be null or missing, as a pipeline's sizing
  would be) is a column of its numbers; a text in words is no figure and no column."""
  shape = record_lib.Maybe({"depth": record_lib.COUNT, "why": record_lib.TEXT})
  monkeypatch.setitem(record_lib.SHAPES, record_lib.ORCHESTRATOR,
                      {**record_lib.SHAPES[record_lib.ORCHESTRATOR], "?sizing": shape})
  records = orchestrator_records(3)
  records[1]["sizing"] = None
  records[2]["sizing"] = {"depth": 2, "why": "a micro-batch's stage 0.30 s against 0.50 s"}
  steps = steps_lib.Steps.of(record_lib.ORCHESTRATOR, records)
  assert steps.values("sizing.depth") == [None, None, 2]
  assert "sizing.why" not in steps.columns and "bound_by" not in steps.columns
