"""`tunix-stage report PATH...`: what staging did in a job, from its processes' metrics records.

Reads the records TUNIX_STAGE_METRICS made (a folder, or record files) into tables (records.py),
tells the runs in them apart (runs.py) and prints, run by run, per process and step, where the
trainer's step went (compute, input wait mid-step and at the boundary, other calls, the compute's
slowdown beside transfers) and what the orchestrator staged and sent; then the run's medians,
what staging hid against an inline estimate (or, for a run that did not stage, why and what
turns it on), the transports' speeds (summary.py), and which setting held staging back
(core/advice.py), checked against the simulator where the lab is installed. Two runs named apart
are compared (compare.py); `--png` draws the job (picture.py, matplotlib). SIGINT or SIGTERM
ends it with one line, exit 130 or 143. docs/observability.md "tunix-stage report".
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import signal
import sys
from typing import Any

import pandas as pd

from tunix_stage_plugin.core import advice as advice_lib
from tunix_stage_plugin.core import inputs
from tunix_stage_plugin.core import install_hint
from tunix_stage_plugin.core.telemetry import figures as figures_lib
from tunix_stage_plugin.core.telemetry import record as record_lib
from tunix_stage_plugin.reading import compare as compare_lib
from tunix_stage_plugin.reading import picture as picture_lib
from tunix_stage_plugin.reading import records as records_lib
from tunix_stage_plugin.reading import runs as runs_lib
from tunix_stage_plugin.reading import summary as summary_lib

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
# reading layer imports nothing from the lab: tests/test_layout.py).
CHECKER = "tunix_stage_plugin.lab.sim.advice"
NOTHING = "nothing to change: staging kept the trainer's input ready"
NO_TRAINER_RECORD = ("nothing these records can tell: no trainer record says what held staging "
                     "back (TUNIX_STAGE_METRICS on the trainer writes one)")
NO_STEP_STAGED = "nothing the rule names: no step staged for it to judge"
GIB = figures_lib.GIB


def add_parser(subparsers: argparse._SubParsersAction, help_line: str) -> None:
  parser = subparsers.add_parser(
      "report",
      help=help_line,
      description="Read the metrics records a job's processes wrote (TUNIX_STAGE_METRICS=DIR "
      "makes each staging process write DIR/<role>-<host>-<pid>-<run>.jsonl, one record per "
      "step) and print, run by run (records of several jobs are told apart by their processes' "
      "runs and time spans), per step where each trainer step went and what the orchestrator "
      "staged, then the run's medians, what staging hid against an inline estimate, the "
      "transports' speeds and what to change.",
      epilog="Two PATHs, each one run of other processes (e.g. two folders): the runs "
      "compared, each figure's median a step side by side with the change and whether it is "
      f"beyond the step-to-step noise ({compare_lib.TEST}). "
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
                      help="also draw the job to FILE, in the format its name ends with "
                      f"({picture_lib.FORMATS_SAID}): per trainer step, where the step went "
                      "(compute, its slowdown beside transfers inside it, input wait mid-step "
                      "and at the boundary, other calls), the step's own micro-batches staged "
                      "and inline counted above the bar; two runs side by side (needs "
                      f"matplotlib: the '{picture_lib.EXTRA}' extra)")
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


def given_twice(paths: list[str]) -> list[str]:
  """A note per file or folder named more than once (read once); two paths that name one thing
  are one run, and nothing is compared."""
  named: dict[str, list[str]] = {}
  for path in paths:
    named.setdefault(os.path.realpath(path), []).append(path)
  out = []
  for real, same in named.items():
    if len(same) > 1:
      times = "twice" if len(same) == 2 else f"{len(same)} times"
      kind = "folder" if os.path.isdir(real) else "file"
      said = (f"{same[0]} was given {times}" if len(set(same)) == 1
              else f"{' and '.join(dict.fromkeys(same))} name one {kind}, given {times}")
      compared = ("; nothing compared (report A B compares two runs)" if len(paths) == 2
                  else "")
      out.append(f"{said}: read once{compared}")
  return out


_s = figures_lib.seconds


def _table(rows: list[list[str]]) -> list[str]:
  widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
  return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]


def _int(value: Any) -> str:
  return str(int(value))


def trainer_rows(steps: pd.DataFrame) -> list[str]:
  rows = [["step", "step s", "compute", "wait mid", "wait boundary", "other", "slowdown",
           "received", "placed", "pool waits", "bound by"]]
  first = summary_lib.first_steps(steps)
  for r, is_first in zip(steps.itertuples(index=False), first):
    rows.append([_int(r.step), _s(r.step_s), _s(r.compute_s), _s(r.input_wait_mid_step_s),
                 _s(r.input_wait_boundary_s), _s(r.other_s), _s(r.slowdown_s),
                 f"{_int(r.received)} / {figures_lib.size(r.received_bytes)}",
                 f"{_int(r.placed)} / {_s(r.placed_s)} s",
                 f"{_int(r.pool_waits)} ({_int(r.pool_over_bound)} over)",
                 summary_lib.FIRST if is_first else str(r.bound_by)])
  return _table(rows)


def orchestrator_rows(steps: pd.DataFrame) -> list[str]:
  rows = [["step", "micro-batches", "staged", "prestaged", "inline", "fallbacks", "sent",
           "stage call median"]]
  for r in steps.to_dict("records"):
    sent = ", ".join(f"{name} {figures_lib.size(r[f'sent_{name}_bytes'])}"
                     for name in figures_lib.TRANSPORTS if r[f"sent_{name}_calls"])
    rows.append([_int(r["step"]), _int(r["microbatches"]), _int(r["staged"]),
                 _int(r["prestaged"]), _int(r["inline"]), _int(r["fallbacks"]), sent or "-",
                 _s(r["stage_call_median_s"])])
  return _table(rows)


def sizing_lines(steps: pd.DataFrame) -> list[str]:
  """Each step's choice of a depth or bound sized by itself (auto), and why; [] for none."""
  return [f"step {int(step)}: {why}" for step, why in zip(steps["step"], steps["sizing"])
          if isinstance(why, str)]


def staging_line(summary: dict[str, Any]) -> str | None:
  """Where a run did not stage: which process says so and why, the setting that turns staging on
  and what the simulator predicts of it (summarize's); None where it staged."""
  staging = summary["staging"]
  if staging["staged"]:
    return None
  line = f"did not stage: {staging['said']}"
  turn_on = next((a for a in summary["advice"] if a["kind"] == TURN_ON), None)
  if turn_on is not None:
    p = turn_on["prediction"]
    line += f"; turned on by {staging['turn_on']}" + (
        f"; what it would give is {turn_on['checked']}" if p is None else f": at the default, "
        f"simulate predicts {p['after_s']:.2f} s a step against {p['before_s']:.2f} s inline on "
        "this record")
  return line


def overall_lines(summary: dict[str, Any]) -> list[str]:
  out = []
  staging = staging_line(summary)
  if staging is not None:
    out.append(staging)
  t = summary.get("trainer")
  if t is not None:
    bound = [f"{b} in {n}" for b, n in t["bound_by"].items() if n]
    first = t["first_steps"]
    if first:
      bound.append(f"{first} {summary_lib.FIRST if first == 1 else summary_lib.FIRSTS} not judged")
    estimate = t["inline_wait_estimate_s"]
    share = f" ({t['hidden_s'] / estimate:.0%})" if estimate else ""
    slowdown = lines_slowdown(t["slowdown_s"])
    which = ("trainer step (its first only, which compiles: shown, never advised on)"
             if t["only_first"] else "trainer step")
    out += [f"{which}: median {_s(t['step_s'])} s = compute {_s(t['compute_s'])}{slowdown} "
            f"+ input wait {_s(t['input_wait_s'])} (mid-step {_s(t['mid_step_s'])}, boundary "
            f"{_s(t['boundary_s'])}) + other calls {_s(t['other_s'])}",
            f"bound by: {', '.join(bound)} (steps)"]
    paths = t["by_path"]
    if paths["staged"]["steps"] and paths["inline"]["steps"]:
      out.append("input wait a step: " + ", ".join(
          f"{_s(p['input_wait_s'])} s {path} ({p['steps']} step{'' if p['steps'] == 1 else 's'})"
          for path, p in paths.items()))
    if t["hidden_s"] is not None:  # some step staged
      out.append(f"staging hid {_s(t['hidden_s'])} s a step of an inline estimate of "
                 f"{_s(estimate)} s of input wait{share}"
                 + (" (in the steps that staged)" if paths["inline"]["steps"] else ""))
    for name, tr in t["received"].items():
      rate = "" if tr["gib_s"] is None else f" at {figures_lib.speed(tr['gib_s'] * GIB)}"
      out.append(f"received by {figures_lib.TRANSPORTS[name]}: {tr['calls']} calls, "
                 f"{figures_lib.size(tr['bytes'])}{rate}")
  o = summary.get("orchestrator")
  if o is not None:
    kinds = "".join(f", {n} {k}" for k, n in o["fallbacks_by_kind"].items())
    out.append(f"orchestrator: staged {o['staged']} ({o['prestaged']} across a boundary), "
               f"inline {o['inline']}, fallbacks {o['fallbacks']}{kinds}; stage call median "
               f"{_s(o['stage_call_median_s'])} s")
    for name, tr in o["sent"].items():  # a call's time includes its wait on the trainer
      out.append(f"sent by {figures_lib.TRANSPORTS[name]}: {tr['calls']} calls, "
                 f"{figures_lib.size(tr['bytes'])}, {tr['seconds'] / tr['calls']:.3f} s a "
                 "call (its wait on the trainer included)")
  return out


def lines_slowdown(seconds: float | None) -> str:
  """The median slowdown, said inside the compute it is part of, where any step knew it."""
  return "" if seconds is None else f" ({_s(seconds)} of it slower beside transfers)"


def shown(process: runs_lib.Process, steps: int | None) -> pd.DataFrame:
  """The steps of `process` its table shows: its last `steps` (DEFAULT_STEPS unless given)."""
  n = DEFAULT_STEPS if steps is None else steps
  return process.steps.iloc[len(process.steps) - min(n, len(process.steps)):]


def record_of(role: str, row: dict[str, Any]) -> dict[str, Any]:
  """A step's row as its record held it (core/telemetry/record.py's fields): what `--json`
  prints. A family's entries are those the step had (its first figure, a transport's calls or a
  fallback kind's count, not 0); a field a record may lack is null where not known."""
  run = None if _null(row["run"]) else str(row["run"])
  out: dict[str, Any] = {
      "schema": record_lib.SCHEMA, "version": record_lib.VERSION if run else 1, "role": role,
      "host": str(row["host"]), "process": {"pid": int(row["pid"]),
                                            "hostname": str(row["hostname"])},
      **({"run": {"id": run, "started": float(row["run_started"])}} if run else {}),
      "time": float(row["time"]), "step": int(row["step"]),
      "settings": {s.field: runs_lib.setting(pd.Series(row), s.field)
                   for s in record_lib.CARRIED if not _null(row[s.field])}}
  present: dict[tuple[str, ...], bool] = {}
  for f in figures_lib.BY_ROLE[role].values():
    value = None if _null(row[f.name]) else row[f.name]
    if not f.path:
      continue
    if f.family is not None:
      at = out
      for key in f.family:  # the family's object, empty where the step had no entry
        at = at.setdefault(key, {})
      if not present.setdefault(f.path[:len(f.family) + 1], bool(value)):
        continue  # an entry the step did not have
    if value is not None:
      value = (int(value) if f.unit in (figures_lib.COUNT, figures_lib.BYTES) else
               str(value) if f.unit in (figures_lib.TEXT, figures_lib.CAUSE) else float(value))
    at = out
    for key in f.path[:-1]:
      at = at.setdefault(key, {})
    at[f.path[-1]] = value
  return out


def _null(value: Any) -> bool:
  return value is None or (isinstance(value, float) and value != value)


def as_json(run_: runs_lib.Run, steps: int | None) -> dict[str, Any]:
  return {"label": run_.label, "started": run_.started,
          "processes": [{"role": p.role, "host": p.host, "process": p.name, "run": p.run,
                         "started": p.started, "steps": len(p.steps),
                         "records": [record_of(p.role, row) for row in
                                     shown(p, steps).to_dict("records")]}
                        for p in run_.processes],
          "summary": summarize(run_)}


class Interrupted(Exception):
  """SIGINT or SIGTERM while the report runs (the signal's number in `args[0]`)."""


def _interrupt(signum: int, _frame: Any) -> None:
  raise Interrupted(signum)


def run(args: argparse.Namespace) -> int:
  """Reports (or compares, or draws) the records `args.paths` name; a signal ends it with one
  line and 128 + its number (130: SIGINT, 143: SIGTERM)."""
  previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
  try:
    return _run(args)
  except (Interrupted, KeyboardInterrupt) as e:
    signum = e.args[0] if isinstance(e, Interrupted) else signal.SIGINT
    print(f"tunix-stage report: interrupted by {signal.Signals(signum).name}", file=sys.stderr)
    return 128 + signum
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)


def _run(args: argparse.Namespace) -> int:
  def error(line: str) -> int:
    print(f"tunix-stage report: error: {line}", file=sys.stderr)
    return 2

  if args.png is not None and (why := picture_lib.refusal(args.png)) is not None:
    return error(why)  # before any record is read
  try:
    found, notes = runs_lib.runs(args.paths)
  except records_lib.RecordError as e:
    return error(str(e))
  notes = given_twice(args.paths) + notes
  if args.png is not None and not any(len(r.trainer_steps) for r in found):
    return error(inputs.invalid("--png", args.png, "records holding a trainer's steps (the "
                                "picture draws them)", "these records hold no trainer step"))
  pair = comparable(args.paths, found)
  if pair is not None:
    compare_lib.run(*pair, summaries=tuple(map(summarize, pair)), as_json=args.json,
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
  if args.png is not None:
    why = picture_lib.draw(args.png, list(pair) if pair is not None else found)
    if why is not None:
      return error(why)
    print(f"tunix-stage report: drew {args.png}", file=sys.stderr)
  return 0


def summarize(run_: runs_lib.Run) -> dict[str, Any]:
  """A run's figures (summary.py), whether it staged, and what to change, checked: for a run that
  did not stage, turning staging on; else the rule's advice. `replay`: the simulator's replay of
  the record with the job's settings (`mode`, `step_s`: its mean step after the first), where
  one was made."""
  summary = summary_lib.summary(run_.trainer_steps, run_.orchestrator_steps)
  summary["staging"] = summary_lib.staging(run_)
  if summary["staging"]["turn_on"] is not None:
    summary["advice"], summary["replay"] = turn_on_advice(run_, summary["staging"])
  else:
    summary["advice"], summary["replay"] = checked_advice(run_)
  summary["recommendations"] = [a["line"] for a in summary["advice"] if a["recommended"]]
  return summary


def _print_run(run_: runs_lib.Run, steps: int | None) -> None:
  for p in run_.processes:
    print(f"{p.role} {p.name} ({p.host}, {len(p.steps)} steps)")
    table = shown(p, steps)
    if len(table):
      rows = trainer_rows if p.role == record_lib.TRAINER else orchestrator_rows
      for line in rows(table) + sizing_lines(table):
        print(f"  {line}")
    left = len(p.steps) - len(table)
    if left and (steps is None or steps):
      print(f"  (the first {left} of its {len(p.steps)} steps left out: --steps N shows the "
            "last N, --steps 0 the summary only)")
  summary = summarize(run_)
  print(f"overall ({summary_lib.RULE}):")
  for line in overall_lines(summary):
    print(f"  {line}")
  replay = summary["replay"]
  if replay is not None:  # what the predictions start from, beside what the job measured
    print(f"checked by simulate: its replay of the record as {replay['mode']} takes "
          f"{replay['step_s']:.2f} s a step with the job's settings (the job measured "
          f"{_s(summary['trainer']['step_s'])} s, median)")
  for line in advice_lines(summary["advice"], nothing_named(summary)):
    print(line)


def _checker() -> Any:
  """The simulator's check (lab/sim/advice.py), or None where the lab is not installed."""
  try:
    return importlib.import_module(CHECKER)
  except ImportError:  # the lab or its libraries are not installed
    return None


NO_LAB = f"not checked (simulate needs the [bench] extra: {install_hint.install_command('bench')})"
NO_TRAINER = ("not checked (no trainer record to replay: the trainer writes one with the plugin, "
              "staging on and TUNIX_STAGE_METRICS)")
TURN_ON = "staging off"  # the advice's kind for a run that did not stage


def checked_advice(run_: runs_lib.Run) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
  """The rule's advice on the job (core/advice.py), each with the simulator's prediction on the
  same record where the lab is installed: recommended where it predicts a shorter step (largest
  gain first), or where it cannot say (marked not checked, and why); and the replay the
  predictions start from."""
  window = summary_lib.window(run_)
  advice = advice_lib.advise(window, auto=_sized_depth(run_))
  if not advice:
    return [], None
  checker = _checker()
  checks = (checker.predict(run_.trainer_steps, window.settings, advice) if checker is not None
            else [NO_LAB] * len(advice))
  before = next((c.before_s for c in checks if not isinstance(c, str)), None)
  return _entries(advice, checks), (None if before is None else
                                    {"mode": window.settings.mode, "step_s": before})


def _sized_depth(run_: runs_lib.Run) -> bool:
  """Whether the run's orchestrator sized its depth each step (auto)."""
  return bool(run_.orchestrator_steps["sizing"].notna().any())


def turn_on_advice(run_: runs_lib.Run, staging: dict[str, Any]
                   ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
  """A run that did not stage, told the setting that turns staging on (summary.staging's),
  checked as the simulator replays its trainer's record inline and staged at the default; and
  that inline replay."""
  trainer, orchestrator = run_.trainer_steps, run_.orchestrator_steps
  steps, field = ((trainer, "placed_inline") if len(trainer) and not len(orchestrator)
                  else (orchestrator, "inline"))
  inline = steps[field].to_numpy()
  said = f"micro-batches {'placed' if field == 'placed_inline' else 'trained'} inline"
  figure = advice_lib.Figure(said, float(inline.mean()), int((inline > 0).sum()), len(inline),
                             unit="")
  advice = advice_lib.Advice(
      TURN_ON, staging["turn_on"], figure, "the staged micro-batches' memory, within "
      "TUNIX_STAGE_MEMORY_BUDGET", "turns staging on, its depth sized each step (auto, the "
      "default)", None)
  window = summary_lib.window(run_)
  checker = _checker()
  check = (NO_TRAINER if window is None else NO_LAB if checker is None
           else checker.staging_on(trainer, window.settings))
  replay = None if isinstance(check, str) else {"mode": checker.INLINE, "step_s": check.before_s}
  return _entries([advice], [check]), replay


def _entries(advice: list[advice_lib.Advice], checks: list[Any]) -> list[dict[str, Any]]:
  """Each advice with its check: a prediction, or why it has none (one line)."""
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


def advice_lines(advice: list[dict[str, Any]], nothing: str = NOTHING) -> list[str]:
  """Each change the simulator predicts no gain from, then each recommendation (the last line:
  a recommendation, or that there is nothing to change: `nothing` where the rule named none)."""
  out = [f"not recommended: {a['line']} (no shorter)" for a in advice if not a["recommended"]]
  out += [f"recommendation: {a['line']}" for a in advice if a["recommended"]]
  if not any(a["recommended"] for a in advice):
    out.append("recommendation: " + (nothing if not advice else "nothing to change: simulate "
                                     "predicts none of the changes above shortens the step"))
  return out


def nothing_named(summary: dict[str, Any]) -> str:
  """What the report says where the rule named nothing: that staging kept the trainer's input
  ready only where a trainer's record shows it, and its steps staged."""
  if "trainer" not in summary:
    return NO_TRAINER_RECORD
  return NOTHING if summary["staging"]["staged"] else NO_STEP_STAGED
