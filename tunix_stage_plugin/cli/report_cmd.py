"""`tunix-stage report PATH...`: what staging did in a job, from its processes' metrics records.

Reads the records TUNIX_STAGE_METRICS made (a folder, or record files) as a stream, tells the runs
in them apart (core.telemetry.runs) and prints, run by run, per process and step, where the
trainer's step went (compute, input wait mid-step and at the boundary, other calls, the compute's
slowdown beside transfers) and what the orchestrator staged and sent; then the run's medians,
what staging hid against an inline estimate, the transports' speeds, and which setting held
staging back (core.telemetry.advice), checked against the simulator where the lab is installed.
Two runs named apart are compared (report_compare.py); `--png` draws the job, in the lab
(lab/report_picture.py, loaded only then: matplotlib is a lab library). docs/observability.md
"tunix-stage report".
"""

from __future__ import annotations

import argparse
import dataclasses
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
from tunix_stage_plugin.core.telemetry import runs as runs_lib

# The steps each process's table shows unless --steps says: its last ones (a long record's table
# would be its length in lines; the summary is over every step).
DEFAULT_STEPS = 50
MAX_STEPS = 10**9


def _steps(text: str) -> int:
  try:
    return inputs.integer(text, minimum=0, maximum=MAX_STEPS)
  except inputs.Refused as e:
    raise argparse.ArgumentTypeError(inputs.refusal("", text, e)) from None


# The simulator's check of the advice, imported by name and only where the lab is installed (the
# production path imports nothing from the lab: tests/test_layout.py).
CHECKER = "tunix_stage_plugin.lab.sim.advice"
NOTHING = "nothing to change: staging kept the trainer's input ready"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
  parser = subparsers.add_parser(
      "report",
      help="what staging did in a job, from its metrics records (TUNIX_STAGE_METRICS)",
      description="Read the metrics records a job's processes wrote (TUNIX_STAGE_METRICS=DIR "
      "makes each staging process write DIR/<role>-<host>-<pid>-<run>.jsonl, one record per "
      "step) and print, run by run (records of several jobs are told apart by their processes' "
      "runs and time spans), per step where each trainer step went and what the orchestrator "
      "staged, then the run's medians, what staging hid against an inline estimate, the "
      "transports' speeds and what to change.",
      epilog="Two PATHs, each one run of other processes (e.g. two folders): the runs "
      "compared, each figure's median a step side by side with the change and whether it is "
      f"beyond the step-to-step noise ({report_compare.TEST}). "
      "example: tunix-stage report /tmp/job-metrics   (docs/observability.md)")
  parser.add_argument("paths", nargs="+", metavar="PATH",
                      help="the folder TUNIX_STAGE_METRICS named, or record files")
  parser.add_argument("--steps", type=_steps, default=None, metavar="N",
                      help=f"each process's last N steps in its table (0: the summary only; "
                      f"default: up to {DEFAULT_STEPS}, saying how many were left out); the "
                      "summary is over every step")
  parser.add_argument("--json", action="store_true", help="print one JSON object instead (each "
                      "process's records within --steps)")
  parser.add_argument("--png", metavar="FILE",
                      help="also draw the job to FILE: per trainer step, where the step went "
                      "(compute, its slowdown beside transfers inside it, input wait mid-step "
                      "and at the boundary, other calls), its staged and inline micro-batches "
                      "counted above the bar; two runs side by side (needs matplotlib: the "
                      "'bench' extra)")
  parser.set_defaults(run=run)


def comparable(paths: list[str], found: list[runs_lib.Run]
               ) -> tuple[runs_lib.Run, runs_lib.Run] | None:
  """Two paths given, each holding one run of its own: the two runs (in the paths' order), to
  compare, each labelled by its path."""
  by_source = {r.sources: r for r in found}
  if len(paths) == len(found) == 2 and set(by_source) == {(paths[0],), (paths[1],)}:
    # Each named by the path the user gave it (A and B in the comparison and the picture).
    return (dataclasses.replace(by_source[(paths[0],)], label=paths[0]),
            dataclasses.replace(by_source[(paths[1],)], label=paths[1]))
  return None


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


def sizing_lines(records: list[dict[str, Any]]) -> list[str]:
  """Each step's choice of a depth or bound sized by itself (auto), and why; [] for none."""
  return [f"step {r['step']}: {r['sizing']}" for r in records if r.get("sizing")]


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


def shown(process: runs_lib.Process, steps: int | None) -> list[dict[str, Any]]:
  """The records of `process` its table shows: its last `steps` (DEFAULT_STEPS unless given),
  read from its files (a run keeps its steps' figures, not its records)."""
  return process.records(DEFAULT_STEPS if steps is None else steps)


def as_json(run_: runs_lib.Run, steps: int | None) -> dict[str, Any]:
  return {"label": run_.label, "started": run_.started,
          "processes": [{"role": p.role, "host": p.host, "process": p.name, "run": p.run,
                         "started": p.started, "steps": len(p.steps),
                         "records": shown(p, steps)} for p in run_.processes],
          "summary": summarize(run_)}


def _picture_target(path: str) -> str | None:
  """Why `path` cannot take the picture (one line), or None."""
  folder = os.path.dirname(os.path.abspath(path))
  why = ("a folder" if os.path.isdir(path) else
         "its folder is not a folder that exists" if not os.path.isdir(folder) else
         "not writable" if not os.access(path if os.path.exists(path) else folder, os.W_OK)
         else None)
  return None if why is None else inputs.invalid("--png", path, "a PNG file to write", why)


def _draw(path: str, runs: list[runs_lib.Run]) -> str | None:
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
    found, notes = runs_lib.runs(args.paths)
  except record_lib.RecordError as e:
    return error(str(e))
  if args.png is not None and not any(len(r.trainer_steps) for r in found):
    return error(inputs.invalid("--png", args.png, "records holding a trainer's steps (the "
                                "picture draws them)", "these records hold no trainer step"))
  pair = comparable(args.paths, found)
  try:  # the records shown are read again: a file changed since is one line
    if pair is not None:
      report_compare.run(*pair, summaries=tuple(map(summarize, pair)), as_json=args.json,
                         notes=notes)
    elif args.json:
      print(json.dumps({"runs": [as_json(r, args.steps) for r in found], "notes": notes},
                       indent=2))
    else:
      for note in notes:
        print(f"note: {note}")
      if len(found) > 1:
        print(f"{len(found)} runs (jobs) in these records, each reported apart; give one run's "
              "files to read it alone")
      for n, run_ in enumerate(found, start=1):
        print(f"run {n} of {len(found)}: {run_.label}" if len(found) > 1
              else f"run: {run_.label}")
        _print_run(run_, args.steps)
  except record_lib.RecordError as e:
    return error(str(e))
  if args.png is not None:
    why = _draw(args.png, list(pair) if pair is not None else found)
    if why is not None:
      return error(why)
    print(f"tunix-stage report: drew {args.png}", file=sys.stderr)
  return 0


def summarize(run_: runs_lib.Run) -> dict[str, Any]:
  """A run's figures (core.telemetry.analysis) and the rule's advice on it, checked."""
  summary = analysis.summary(run_.trainer_steps, run_.orchestrator_steps)
  summary["advice"] = checked_advice(run_)
  summary["recommendations"] = [a["line"] for a in summary["advice"] if a["recommended"]]
  return summary


def _print_run(run_: runs_lib.Run, steps: int | None) -> None:
  for p in run_.processes:
    print(f"{p.role} {p.name} ({p.host}, {len(p.steps)} steps)")
    records = shown(p, steps)
    if records:
      rows = trainer_rows if p.role == record_lib.TRAINER else orchestrator_rows
      for line in rows(records) + sizing_lines(records):
        print(f"  {line}")
    left = len(p.steps) - len(records)
    if left and (steps is None or steps):
      print(f"  (the first {left} of its {len(p.steps)} steps left out: --steps N shows the "
            "last N, --steps 0 the summary only)")
  summary = summarize(run_)
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


def checked_advice(run_: runs_lib.Run) -> list[dict[str, Any]]:
  """The rule's advice on the job (core.telemetry.advice), each with the simulator's prediction
  on the same record where the lab is installed: recommended where it predicts a shorter step
  (largest gain first), or where it cannot say (marked not checked, and why)."""
  window = advice_lib.Window.of_steps(run_.trainer_steps, run_.orchestrator_steps)
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
    checks = checker.predict(run_.records(record_lib.TRAINER, checker.CHECK_STEPS),
                             window.settings, advice)
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
