"""`tunix-stage report PATH...`: what staging did in a job, from its processes' metrics records.

Reads the records TUNIX_STAGE_METRICS made (a folder, or record files) and prints, per process
and step, where the trainer's step went (compute, input wait mid-step and at the boundary, other
calls, the compute's slowdown beside transfers) and what the orchestrator staged and sent; then
the job's medians, what staging hid against an inline estimate, the transports' speeds, and which
setting held staging back (core.telemetry.advice), checked against the simulator where the lab is
installed. Two runs are compared (report_compare.py); `--png` draws the job, in the lab
(lab/report_picture.py, loaded only then: matplotlib is a lab library). docs/observability.md
"tunix-stage report".
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any

from tunix_stage_plugin.cli import report_compare
from tunix_stage_plugin.core import inputs
from tunix_stage_plugin.core import install_hint
from tunix_stage_plugin.core.telemetry import advice as advice_lib
from tunix_stage_plugin.core.telemetry import analysis
from tunix_stage_plugin.core.telemetry import lines
from tunix_stage_plugin.core.telemetry import record as record_lib


# The simulator's check of the advice, imported by name and only where the lab is installed (the
# production path imports nothing from the lab: tests/test_layout.py).
CHECKER = "tunix_stage_plugin.lab.sim.advice"
NOTHING = "nothing to change: staging kept the trainer's input ready"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
  parser = subparsers.add_parser(
      "report",
      help="what staging did in a job, from its metrics records (TUNIX_STAGE_METRICS)",
      description="Read the metrics records a job's processes wrote (TUNIX_STAGE_METRICS=DIR "
      "makes each staging process write DIR/<role>-<host>-<pid>.jsonl, one record per step) "
      "and print, per step, where each trainer step went and what the orchestrator staged, "
      "then the job's medians, what staging hid against an inline estimate, the transports' "
      "speeds and what to change.",
      epilog="Two PATHs, each one run of other processes (e.g. two folders): the runs "
      "compared, each figure's median a step side by side with the change and whether it is "
      f"beyond the step-to-step noise ({report_compare.TEST}). "
      "example: tunix-stage report /tmp/job-metrics   (docs/observability.md)")
  parser.add_argument("paths", nargs="+", metavar="PATH",
                      help="the folder TUNIX_STAGE_METRICS named, or record files")
  parser.add_argument("--json", action="store_true", help="print one JSON object instead")
  parser.add_argument("--png", metavar="FILE",
                      help="also draw the job to FILE: per trainer step, where the step went "
                      "(compute, its slowdown beside transfers inside it, input wait mid-step "
                      "and at the boundary, other calls), its staged and inline micro-batches "
                      "counted above the bar; two runs side by side (needs matplotlib: the "
                      "'bench' extra)")
  parser.set_defaults(run=run)


def load(paths: list[str]) -> tuple[list[dict[str, Any]], list[str]]:
  """Every record of `paths`, by process and step; and the notes on files cut short."""
  records, notes = [], []
  for path in record_lib.files(paths):
    found, note = record_lib.read(path)
    records += found
    if note is not None:
      notes.append(note)
  return records, notes


def processes(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """One entry per process and role: who it was and its records in step order."""
  out: dict[tuple[str, str, int], dict[str, Any]] = {}
  for r in records:
    key = (r["role"], r["process"]["hostname"], r["process"]["pid"])
    entry = out.setdefault(key, {"role": r["role"], "host": r["host"],
                                 "process": f"{key[1]}:{key[2]}", "records": []})
    entry["records"].append(r)
  for entry in out.values():
    entry["records"].sort(key=lambda r: r["step"])
  return sorted(out.values(), key=lambda e: (e["role"] != record_lib.TRAINER, e["process"]))


def _s(seconds: float | None) -> str:
  return "-" if seconds is None else f"{seconds:.2f}"


def _table(rows: list[list[str]]) -> list[str]:
  widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
  return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]


def trainer_rows(records: list[dict[str, Any]]) -> list[str]:
  rows = [["step", "step s", "compute", "wait mid", "wait boundary", "other", "slowdown",
           "received", "placed", "pool waits", "bound by"]]
  for r in records:
    wait, received = r["input_wait_s"], r["receive"]
    rows.append([str(r["step"]), _s(r["step_s"]), _s(r["compute_s"]), _s(wait["mid_step"]),
                 _s(wait["boundary"]), _s(r["other_s"]), _s(r["compute"]["slowdown_s"]),
                 f"{received['calls']} / {lines.size(received['bytes'])}",
                 f"{r['place']['count']} / {_s(r['place']['seconds'])} s",
                 f"{r['pool']['waits']} ({r['pool']['over_bound']} over)", r["bound_by"]])
  return _table(rows)


def orchestrator_rows(records: list[dict[str, Any]]) -> list[str]:
  rows = [["step", "micro-batches", "staged", "prestaged", "inline", "fallbacks", "sent",
           "stage call median"]]
  for r in records:
    sent = ", ".join(f"{name} {lines.size(t['bytes'])}" for name, t in r["sent"].items())
    rows.append([str(r["step"]), str(r["microbatches"]), str(r["staged"]), str(r["prestaged"]),
                 str(r["inline"]), str(r["fallbacks"]["count"]), sent or "-",
                 _s(r["stage_calls"]["median_s"])])
  return _table(rows)


def overall_lines(summary: dict[str, Any]) -> list[str]:
  out = []
  t = summary.get("trainer")
  if t is not None:
    bound = ", ".join(f"{b} in {n}" for b, n in t["bound_by"].items() if n)
    estimate = t["inline_wait_estimate_s"]
    share = f" ({t['hidden_s'] / estimate:.0%})" if estimate > 0 else ""
    slowdown = lines.slowdown(t["slowdown_s"], 0)  # the median's, where any step knew it
    out += [f"trainer step: median {_s(t['step_s'])} s = compute {_s(t['compute_s'])}{slowdown} "
            f"+ input wait {_s(t['input_wait_s'])} (mid-step {_s(t['mid_step_s'])}, boundary "
            f"{_s(t['boundary_s'])}) + other calls {_s(t['other_s'])}",
            f"bound by: {bound} (steps)"]
    paths = t["by_path"]
    if paths["staged"]["steps"] and paths["inline"]["steps"]:
      out.append("input wait a step: " + ", ".join(
          f"{_s(p['input_wait_s'])} s {path} ({p['steps']} step{'' if p['steps'] == 1 else 's'})"
          for path, p in paths.items()))
    out.append(f"staging hid {_s(t['hidden_s'])} s a step of an inline estimate of "
               f"{_s(estimate)} s of input wait{share}"
               + (" (in the steps that staged)" if paths["inline"]["steps"] else ""))
    for name, tr in t["received"].items():
      rate = "" if tr["gib_s"] is None else f" at {lines.speed(tr['gib_s'] * lines.GIB)}"
      out.append(f"received by {lines.TRANSPORT_NAMES.get(name, name)}: {tr['calls']} calls, "
                 f"{lines.size(tr['bytes'])}{rate}")
  o = summary.get("orchestrator")
  if o is not None:
    kinds = "".join(f", {n} {k}" for k, n in o["fallbacks_by_kind"].items())
    out.append(f"orchestrator: staged {o['staged']} ({o['prestaged']} across a boundary), "
               f"inline {o['inline']}, fallbacks {o['fallbacks']}{kinds}; stage call median "
               f"{_s(o['stage_call_median_s'])} s")
    for name, tr in o["sent"].items():  # a call's time includes its wait on the trainer
      out.append(f"sent by {lines.TRANSPORT_NAMES.get(name, name)}: {tr['calls']} calls, "
                 f"{lines.size(tr['bytes'])}, {tr['seconds'] / tr['calls']:.3f} s a "
                 "call (its wait on the trainer included)")
  return out


def _run_of(path: str) -> report_compare.Run:
  """LEAD: the records helper's run grouping replaces this (one PATH -> one Run here)."""
  procs = processes(load([path])[0])
  return report_compare.Run(
      label=path,
      trainer=[r for p in procs if p["role"] == record_lib.TRAINER for r in p["records"]],
      orchestrator=[r for p in procs if p["role"] == record_lib.ORCHESTRATOR
                    for r in p["records"]])


def _pair(paths: list[str]) -> tuple[report_compare.Run, report_compare.Run] | None:
  """The two runs to compare: two PATHs, each holding a trainer's records, no trainer process
  in both (a job's trainer record and its orchestrator's, named apart, are one job: None).
  SEAM: the lead merges this with the records helper's run grouping."""
  if len(paths) != 2:
    return None
  runs = [_run_of(path) for path in paths]

  def trainers(run: report_compare.Run) -> set[tuple[str, int]]:
    return {(r["process"]["hostname"], r["process"]["pid"]) for r in run.trainer}

  if not all(run.trainer for run in runs) or trainers(runs[0]) & trainers(runs[1]):
    return None
  return runs[0], runs[1]


def _picture_target(path: str) -> str | None:
  """Why `path` cannot take the picture (one line), or None."""
  folder = os.path.dirname(os.path.abspath(path))
  why = ("a folder" if os.path.isdir(path) else
         "its folder is not a folder that exists" if not os.path.isdir(folder) else
         "not writable" if not os.access(path if os.path.exists(path) else folder, os.W_OK)
         else None)
  return None if why is None else inputs.invalid("--png", path, "a PNG file to write", why)


def _draw(path: str, runs: list[report_compare.Run]) -> str | None:
  """Draws `runs` to `path` (lab/report_picture.py, loaded only here); the one line of why not."""
  picture = importlib.import_module("tunix_stage_plugin.lab.report_picture")
  try:
    picture.draw(path, runs)
  except picture.PictureError as e:
    return str(e)
  except (OSError, ValueError) as e:
    return inputs.invalid("--png", path, "a PNG file to write", f"{type(e).__name__}: {e}")
  return None


def run(args: argparse.Namespace) -> int:
  def error(line: str) -> int:
    print(f"tunix-stage report: error: {line}", file=sys.stderr)
    return 2

  if args.png is not None and (why := _picture_target(args.png)) is not None:
    return error(why)
  try:
    records, notes = load(args.paths)
    pair = _pair(args.paths)
  except record_lib.RecordError as e:
    return error(str(e))
  if pair is not None:
    report_compare.run(*pair, as_json=args.json, notes=notes)
    runs = list(pair)
  else:
    runs = [_report(records, notes, args.json, " ".join(args.paths))]
  if args.png is not None:
    why = _draw(args.png, runs)
    if why is not None:
      return error(why)
    print(f"tunix-stage report: drew {args.png}", file=sys.stderr)
  return 0


def _report(records: list[dict[str, Any]], notes: list[str], as_json: bool, label: str
            ) -> report_compare.Run:
  """Prints the report of one job's records; answers them as one run (for the picture)."""
  procs = processes(records)
  trainer = [r for p in procs if p["role"] == record_lib.TRAINER for r in p["records"]]
  orchestrator = [r for p in procs if p["role"] == record_lib.ORCHESTRATOR
                  for r in p["records"]]
  job = report_compare.Run(label=label, trainer=trainer, orchestrator=orchestrator)
  summary = analysis.summary(trainer, orchestrator)
  summary["advice"] = checked_advice(records, trainer, orchestrator)
  summary["recommendations"] = [a["line"] for a in summary["advice"] if a["recommended"]]
  if as_json:
    print(json.dumps({"processes": procs, "summary": summary, "notes": notes}, indent=2))
    return job
  for note in notes:
    print(f"note: {note}")
  for p in procs:
    print(f"{p['role']} {p['process']} ({p['host']}, {len(p['records'])} steps)")
    rows = trainer_rows if p["role"] == record_lib.TRAINER else orchestrator_rows
    for line in rows(p["records"]):
      print(f"  {line}")
  print(f"overall ({analysis.RULE}):")
  for line in overall_lines(summary):
    print(f"  {line}")
  replay = next((a["prediction"]["before_s"] for a in summary["advice"] if a["prediction"]),
                None)
  if replay is not None:  # what the predictions start from, beside what the job measured
    print(f"checked by simulate: its replay of the record takes {replay:.2f} s a step with the "
          f"job's settings (the job measured {_s(summary['trainer']['step_s'])} s, median)")
  for line in advice_lines(summary["advice"]):
    print(line)
  return job


def checked_advice(records: list[dict[str, Any]], trainer: list[dict[str, Any]],
                   orchestrator: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """The rule's advice on the job (core.telemetry.advice), each with the simulator's prediction
  on the same record where the lab is installed: recommended where it predicts a shorter step
  (largest gain first), or where it cannot say (marked not checked, and why)."""
  window = advice_lib.Window.of_records(trainer, orchestrator)
  advice = advice_lib.advise(window)
  if not advice:
    return []
  try:
    checker = importlib.import_module(CHECKER)
  except ImportError:  # the lab or its libraries are not installed
    checker = None
  if checker is None:
    why = (f"not checked (simulate needs the [bench] extra: "
           f"{install_hint.install_command('bench')})")
    checks = [why] * len(advice)
  else:
    checks = checker.predict(records, window.settings, advice)
  out = []
  for a, check in zip(advice, checks):
    entry = {**a.as_dict(), "line": a.line(), "prediction": None, "checked": None,
             "recommended": True, "gain_s": 0.0}
    if isinstance(check, str):
      entry["checked"] = check
      entry["line"] += f"; {check}"
    else:
      entry["prediction"] = {"before_s": check.before_s, "after_s": check.after_s}
      entry["recommended"] = check.helps
      entry["gain_s"] = check.before_s - check.after_s
      entry["line"] = f"{a.line()}; {check}"
    out.append(entry)
  return sorted(out, key=lambda e: (e["recommended"], e["gain_s"]), reverse=True)


def advice_lines(advice: list[dict[str, Any]]) -> list[str]:
  """Each change the simulator predicts no gain from, then each recommendation (the last line:
  a recommendation, or that there is nothing to change)."""
  out = [f"not recommended: {a['line']} (no shorter)" for a in advice if not a["recommended"]]
  out += [f"recommendation: {a['line']}" for a in advice if a["recommended"]]
  if not any(a["recommended"] for a in advice):
    out.append("recommendation: " + (NOTHING if not advice else "nothing to change: simulate "
                                     "predicts none of the changes above shortens the step"))
  return out
