"""A record folder's steps as a DataFrame (reading.steps, reading/records.py): each column is its
figure (core/telemetry/figures.py) as the one table reads it from the step's figures, `report A
B` compares those columns, `--json` gives back the records written, and pyarrow's reading agrees
with the one check line by line, on good records and on records edited as a hand would. Real
records: the telemetry core's trainer (tests/cli/test_report.py's job) and orchestrator records
made by record.make, as the simulator's are.
"""

from __future__ import annotations

import json
import math
import os
import random
import time

import pytest
from hypothesis import given, settings, strategies as st

from tests.cli.test_report import report, write_trainer_job
from tunix_stage_plugin import reading
from tunix_stage_plugin.core.telemetry import figures as figures_lib
from tunix_stage_plugin.core.telemetry import record as record_lib
from tunix_stage_plugin.reading import compare as compare_lib
from tunix_stage_plugin.reading import records as records_lib

MIB = 1 << 20


def written(path):
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def trainer_records(folder):
  """A real trainer's 6 steps, staged then inline (a pool wait in each), and its file."""
  (path,) = write_trainer_job(folder, steps=6, pool_waits=1, inline_from=3)
  return written(path), path


def orchestrator_records(steps=6):
  """An orchestrator's steps as record.make writes them: some refused, one with a second
  transport, the first with no step before it."""
  rng = random.Random(7)
  run = record_lib.new_run()
  out = []
  for step in range(steps):
    sent = {"side": {"calls": 2, "bytes": 2 * MIB, "seconds": rng.uniform(0.1, 0.2),
                     "gib_s": 0.1}}
    if step == 2:
      sent["unary"] = {"calls": 1, "bytes": MIB, "seconds": 0.3, "gib_s": 0.5}
    refused = step % 2
    figures = {"step": step, "host_step": step + 1, "step_s": None if step == 0 else 2.0,
               "microbatches": 2, "depth": 1, "staged": 2 - refused, "inline": refused,
               "prestaged": 0, "peak_staged": 1,
               "fallbacks": {"count": refused, "by_kind": {"refused": 1} if refused else {}},
               "sent": sent, "stage_calls": {"count": 2, "seconds": 0.4, "median_s": 0.2,
                                             "max_s": None if step == 0 else 0.25}}
    out.append(record_lib.make(record_lib.ORCHESTRATOR, "tunix", figures, {}, run))
  return out


def write(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
  return str(path)


def null(v):
  return v is None or (isinstance(v, float) and math.isnan(v))


def same(a, b):
  """The same value, a null (a text's None, a number's NaN) the same however said."""
  return a == b or (null(a) and null(b))


def test_each_column_is_its_figure_as_the_table_reads_it_from_the_step(tmp_path):
  trainer, path = trainer_records(tmp_path / "t")
  orchestrator = orchestrator_records()
  found = records_lib.read([path, write(tmp_path / "o.jsonl", orchestrator)]).steps
  for role, records in ((record_lib.TRAINER, trainer), (record_lib.ORCHESTRATOR, orchestrator)):
    frame = found[role]
    assert len(frame) == len(records)
    for f in figures_lib.BY_ROLE[role].values():
      expected = [figures_lib.row(role, r)[f.name] for r in records]
      got = frame[f.name].tolist()
      assert all(map(same, got, expected)), (role, f.name, got, expected)
  # A family: a column per name the table knows, 0 in a step that did not send by it.
  sent = found[record_lib.ORCHESTRATOR]
  assert sent["sent_unary_calls"].tolist() == [0, 0, 1, 0, 0, 0]
  assert sent["sent_stream_calls"].tolist() == [0] * 6
  assert sent["fallbacks_refused"].tolist() == [0, 1, 0, 1, 0, 1]
  assert set(found[record_lib.TRAINER]["bound_by"]) <= set(figures_lib.CAUSES)


def test_every_figure_is_a_column_and_every_other_column_a_record_field(tmp_path):
  _, path = trainer_records(tmp_path / "t")
  frame = reading.steps(path, write(tmp_path / "o.jsonl", orchestrator_records()))
  figures = {f.name for f in figures_lib.FIGURES}
  assert figures <= set(frame.columns)
  assert set(frame.columns) - figures == {*records_lib.IDENTITY, "file"}
  # One row per process and step, the run and the role as columns, the trainers' first.
  assert frame["role"].tolist() == ["trainer"] * 6 + ["orchestrator"] * 6
  assert frame.groupby(["role", "run"], observed=True).size().tolist() == [6, 6]
  assert frame["step_s"].isna().tolist() == [True] + [False] * 5 + [True] + [False] * 5


def test_the_file_column_holds_each_row_s_path(tmp_path):
  _, path = trainer_records(tmp_path / "t")
  other = write(tmp_path / "o.jsonl", orchestrator_records())
  frame = reading.steps(str(tmp_path / "t"), other)
  assert frame["file"].tolist() == [path] * 6 + [other] * 6
  assert frame[frame.file == other]["role"].unique().tolist() == ["orchestrator"]


def test_a_cut_last_line_is_a_warning_saying_what_report_says(tmp_path):
  """The notes `report` prints (its `note: ...` lines) are the DataFrame's warnings, word for
  word; the whole records before the cut line are read."""
  _, path = trainer_records(tmp_path)
  with open(path, "a", encoding="utf-8") as f:
    f.write('{"schema": "tunix-stage-metr')
  old = time.time() - 60  # left so a minute: a killed process's
  os.utime(path, (old, old))
  notes = [line.removeprefix("note: ") for line in report(path).stdout.splitlines()
           if line.startswith("note: ")]
  with pytest.warns(reading.RecordWarning) as caught:
    frame = reading.steps(path)
  assert [str(w.message) for w in caught] == notes
  assert len(notes) == 1 and "its last line is cut short" in notes[0]
  assert caught[0].filename == __file__  # said at the caller's line
  assert frame["step"].tolist() == list(range(6))


def test_report_a_b_compares_each_figure_the_table_marks_and_only_those():
  """compare.FIGURES are the table's `compared` figures: the scalars (but a step's bound, a count
  of steps in each run's summary) and the whole input wait; the trainer's input wait first."""
  scalars = {(f.role, f.name) for f in figures_lib.FIGURES
             if f.scalar and not f.name.startswith("bound_by_")}
  assert {(f.role, f.name) for f in compare_lib.FIGURES} == \
      scalars | {(record_lib.TRAINER, "input_wait_s")}
  assert compare_lib.FIGURES[0].name == "input_wait_s"


def with_optional(role, records):
  """`records` with each field a record may lack (figures.FIGURES' `optional`) said, null where
  it lacked it: as --json gives them."""
  out = json.loads(json.dumps(records))
  for rec in out:
    for f in figures_lib.BY_ROLE[role].values():
      if f.optional and f.family is None:
        rec.setdefault(f.path[0], None)
  return out


def test_json_gives_back_the_records_written(tmp_path):
  trainer, _ = trainer_records(tmp_path)
  (run,) = json.loads(report(str(tmp_path), "--json").stdout)["runs"]
  (process,) = run["processes"]
  assert process["records"] == with_optional(record_lib.TRAINER, trainer)
  orchestrator = orchestrator_records()
  (tmp_path / "o").mkdir()
  write(tmp_path / "o" / "orchestrator-x.jsonl", orchestrator)
  (run,) = json.loads(report(str(tmp_path / "o"), "--json").stdout)["runs"]
  assert run["processes"][0]["records"] == with_optional(record_lib.ORCHESTRATOR, orchestrator)


# Edits of a real trainer record's second line, as a hand makes them: each read by pyarrow and
# by the line-by-line check alike (the same steps, or the same one line).
EDITS = {
    "NaN": lambda r: r.__setitem__("step_s", float("nan")),
    "a count past 2**64": lambda r: r["receive"].__setitem__("bytes", 2**64),
    "a 400-digit count": lambda r: r["place"].__setitem__("count", 10**400),
    "a count written 3.0": lambda r: r["place"].__setitem__("count", 3.0),
    "a number as text": lambda r: r.__setitem__("compute_s", "1.0"),
    "true for a count": lambda r: r.__setitem__("microbatches", True),
    "a lone surrogate": lambda r: r.__setitem__("bound_by", "\ud800"),
    "a null that must hold a number": lambda r: r.__setitem__("other_s", None),
    "a nullable field left out": lambda r: r.pop("step_s", None),
    "a nullable field written null": lambda r: r.__setitem__("step_s", None),
    "an optional field left out": lambda r: r.pop("host_step", None),
    "an object left out": lambda r: r.pop("compute", None),
    "an object written null": lambda r: r.__setitem__("pool", None),
    "a transport it does not know": lambda r: r["receive"]["by_transport"].__setitem__(
        "pigeon", {"calls": 1, "bytes": 1, "seconds": 0.5}),
    "a transport it does not know, wrong": lambda r: r["receive"]["by_transport"].__setitem__(
        "pigeon", {"calls": "x"}),
    "a field it does not know": lambda r: r.__setitem__("extra", {"a": [1, "b"]}),
    "another role": lambda r: r.__setitem__("role", "orchestrator"),
    "more staged than placed": lambda r: r["place"].__setitem__("staged", 99),
    "a setting at auto": lambda r: r["settings"].__setitem__("max_host_batches", "auto"),
    "a setting of another kind": lambda r: r["settings"].__setitem__("max_device_batches", "2"),
}
RAW = {  # edits of the line's text itself
    "a blank line": lambda line: line + "\n",
    "a key twice": lambda line: line[:-1] + ', "step": 5}',
    "not JSON": lambda line: line[:20],
    "whitespace around": lambda line: "  " + line + "  ",
}


def outcome(path):
  """What the reader makes of `path`: its trainer steps (as lists) or the line refusing it."""
  try:
    found = records_lib.read([path]).steps
  except records_lib.RecordError as e:
    return str(e)
  return {role: {c: frame[c].astype(object).where(frame[c].notna(), None).tolist()
                 for c in frame.columns} for role, frame in found.items()}


def checked_line_by_line(monkeypatch):
  def refuse(*args):
    raise records_lib._Refused()  # pylint: disable=protected-access
  monkeypatch.setattr(records_lib, "_columns", refuse)


@pytest.mark.parametrize("edit", [*EDITS, *RAW])
def test_pyarrow_s_reading_and_the_one_check_agree(tmp_path, monkeypatch, edit):
  (path,) = write_trainer_job(tmp_path, steps=3)
  with open(path, encoding="utf-8") as f:
    lines = f.read().splitlines()
  if edit in EDITS:
    rec = json.loads(lines[1])
    EDITS[edit](rec)
    lines[1] = json.dumps(rec)
  else:
    lines[1] = RAW[edit](lines[1])
  bad = tmp_path / "edited.jsonl"
  bad.write_text("\n".join(lines) + "\n", encoding="utf-8")
  fast = outcome(str(bad))
  with monkeypatch.context() as m:
    checked_line_by_line(m)
    slow = outcome(str(bad))
  assert fast == slow, edit
  if isinstance(fast, str):  # the line edited (a blank line: the one after it)
    assert fast.startswith(f"{bad}:{3 if edit == 'a blank line' else 2}") and "\n" not in fast



@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(sorted(EDITS)), max_size=3), st.integers(0, 2))
def test_any_edits_of_any_line_are_read_alike(tmp_path_factory, edits, at):
  folder = tmp_path_factory.mktemp("edits")
  (path,) = write_trainer_job(folder, steps=3)
  records = written(path)
  for edit in edits:
    EDITS[edit](records[at])
  bad = folder / "edited.jsonl"
  bad.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
  fast = outcome(str(bad))
  with pytest.MonkeyPatch.context() as m:
    checked_line_by_line(m)
    assert outcome(str(bad)) == fast, edits
