"""The report on real jobs' records says the figures the reader before the reading layer (main at
3984bab: its column store and generated check) printed for the same records, kept as it printed
them beside each record (`report DIR --json --steps 100`, tests/data/<job>.before.json): a
two-process tunix job through the local recipe (tunix c7d8950, `--host tunix --steps 8`, at the
fixed depth 2 and host bound 1: the reader before read no `auto` in a record), an embedded job
(a trainer process and orchestrator_main, 6 steps of 3 micro-batches), and an embedded job
bound by its wire, so that the advice is not empty (`--tiny --payload_mib 2 --wire_mbps 12
--steps 6 --microbatches 4 --max_staged_batches 1`, the trainer's bounds 1 and 1; its expected
file printed by 3984bab's own `report`). What the reading layer changed on purpose, and only
that, differs: a process's first step, its compile, is counted apart from the bounds; a field a
record may lack is said null in `--json`; a size in the advice's cost is said as every size is
(one decimal); the summary says whether the run staged (`staging`) and which replay the
predictions start from (`replay`).
"""

from __future__ import annotations

import json
import pathlib

import pytest

from tests.cli.test_report import report

DATA = pathlib.Path(__file__).parent.parent / "data"
JOBS = sorted(p.name for p in DATA.iterdir() if p.is_dir())
OPTIONAL = {"trainer": ("host_step", "sizing"), "orchestrator": ("host_step", "sizing")}


def report_json(folder):
  return json.loads(report(str(folder), "--json", "--steps", "100").stdout)


def said_null(role, record):
  return {**{k: None for k in OPTIONAL[role]}, **record}


@pytest.mark.parametrize("job", JOBS)
def test_the_report_says_the_figures_the_reader_before_it_said(job):
  before = json.loads((DATA / f"{job}.before.json").read_text(encoding="utf-8"))
  now = report_json(DATA / job)
  assert [r["label"] for r in now["runs"]] == [r["label"] for r in before["runs"]]
  assert now["notes"] == before["notes"] == []
  for run, old in zip(now["runs"], before["runs"]):
    records_of = {}
    for process, was in zip(run["processes"], old["processes"]):
      records = records_of[process["process"]] = process.pop("records")
      assert records == [said_null(was["role"], r) for r in was.pop("records")]
      assert process == was
    summary, was = run["summary"], old["summary"]
    trainer, trainer_was = summary.pop("trainer"), was.pop("trainer")
    # The first steps' bounds counted apart: what each was bound by, taken out of its count.
    firsts = [r["bound_by"] for p in run["processes"] if p["role"] == "trainer"
              for r in records_of[p["process"]] if r["step_s"] is None]
    bound, bound_was = trainer.pop("bound_by"), trainer_was.pop("bound_by")
    assert trainer.pop("first_steps") == len(firsts) == 1 and not trainer.pop("only_first")
    assert {c: bound_was[c] - bound[c] for c in bound} == {c: firsts.count(c) for c in bound}
    assert _same(trainer, trainer_was)
    advice, advice_was = summary.pop("advice"), was.pop("advice")
    assert len(advice) == len(advice_was)
    replay = summary.pop("replay")  # the predictions' start: the job's settings replayed
    assert replay == (None if not advice else {"mode": "depth" + _label_setting(
        run["label"], "max_staged_batches"), "step_s": advice[0]["prediction"]["before_s"]})
    assert summary.pop("staging") == {"staged": True, "said": None, "role": None,
                                      "turn_on": None}
    for a, b in zip(advice, advice_was):
      for key in ("cost", "line"):
        a.pop(key), b.pop(key)
      assert a == b
    recommendations = [r.replace(".0 MiB", " MiB") for r in summary.pop("recommendations")]
    assert recommendations == was.pop("recommendations")
    assert _same(summary, was)


def test_a_record_whose_advice_is_not_empty_is_among_them():
  advice = {job: [len(r["summary"]["advice"]) for r in json.loads(
      (DATA / f"{job}.before.json").read_text(encoding="utf-8"))["runs"]] for job in JOBS}
  assert advice == {"embedded_job": [0], "tunix_job": [0], "wire_bound_job": [2]}


def _label_setting(label, field):
  """A setting's value as a run's label says it (`field=value`)."""
  return next(part.split("=")[1] for part in label.split("; ")[-1].split(", ")
              if part.startswith(f"{field}="))


def _same(a, b):
  """Equal, numbers to 1e-12 of each other."""
  if isinstance(a, dict) and isinstance(b, dict):
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
  if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
    return len(a) == len(b) and all(map(_same, a, b))
  if isinstance(a, float) or isinstance(b, float):
    return a == pytest.approx(b, rel=1e-12, abs=1e-12)
  return a == b
