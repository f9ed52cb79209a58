"""`tunix-stage report PATH...`: what staging did in a job, from its processes' metrics records.

Reads the records TUNIX_STAGE_METRICS made (a folder, or record files) as a stream, tells the runs
in them apart (core.telemetry.runs) and prints, run by run, per process and step, where the
trainer's step went (compute, input wait mid-step and at the boundary, other calls, the compute's
slowdown beside transfers) and what the orchestrator staged and sent; then the run's medians,
what staging hid against an inline estimate, the transports' speeds, and which setting held
staging back (core.telemetry.analysis). docs/observability.md "tunix-stage report".
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tunix_stage_plugin.core import inputs
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
      epilog="example: tunix-stage report /tmp/job-metrics   (docs/observability.md)")
  parser.add_argument("paths", nargs="+", metavar="PATH",
                      help="the folder TUNIX_STAGE_METRICS named, or record files")
  parser.add_argument("--steps", type=_steps, default=None, metavar="N",
                      help=f"each process's last N steps in its table (0: the summary only; "
                      f"default: up to {DEFAULT_STEPS}, saying how many were left out); the "
                      "summary is over every step")
  parser.add_argument("--json", action="store_true", help="print one JSON object instead (each "
                      "process's records within --steps)")
  parser.set_defaults(run=run)


def comparable(paths: list[str], found: list[runs_lib.Run]
               ) -> tuple[runs_lib.Run, runs_lib.Run] | None:
  """Two paths given, each holding one run of its own: the two runs (in the paths' order), to
  compare."""
  by_source = {r.sources: r for r in found}
  if len(paths) == len(found) == 2 and set(by_source) == {(paths[0],), (paths[1],)}:
    return by_source[(paths[0],)], by_source[(paths[1],)]
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
                 f"{received['calls']} / {received['bytes'] / lines.MIB:.1f} MiB",
                 f"{r['place']['count']} / {_s(r['place']['seconds'])} s",
                 f"{r['pool']['waits']} ({r['pool']['over_bound']} over)", r["bound_by"]])
  return _table(rows)


def orchestrator_rows(records: list[dict[str, Any]]) -> list[str]:
  rows = [["step", "micro-batches", "staged", "prestaged", "inline", "fallbacks", "sent",
           "stage call median"]]
  for r in records:
    sent = ", ".join(f"{name} {t['bytes'] / lines.MIB:.1f} MiB" for name, t in r["sent"].items())
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
    out += [f"trainer step: median {_s(t['step_s'])} s = compute {_s(t['compute_s'])} + input "
            f"wait {_s(t['input_wait_s'])} (mid-step {_s(t['mid_step_s'])}, boundary "
            f"{_s(t['boundary_s'])}) + other calls {_s(t['other_s'])}; the compute "
            f"{_s(t['slowdown_s'])} s slower beside transfers",
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
      rate = "" if tr["gib_s"] is None else f" at {tr['gib_s']:.2f} GiB/s"
      out.append(f"received by {lines.TRANSPORT_NAMES.get(name, name)}: {tr['calls']} calls, "
                 f"{tr['bytes'] / lines.GIB:.2f} GiB{rate}")
  o = summary.get("orchestrator")
  if o is not None:
    kinds = "".join(f", {n} {k}" for k, n in o["fallbacks_by_kind"].items())
    out.append(f"orchestrator: staged {o['staged']} ({o['prestaged']} across a boundary), "
               f"inline {o['inline']}, fallbacks {o['fallbacks']}{kinds}; stage call median "
               f"{_s(o['stage_call_median_s'])} s")
    for name, tr in o["sent"].items():  # a call's time includes its wait on the trainer
      out.append(f"sent by {lines.TRANSPORT_NAMES.get(name, name)}: {tr['calls']} calls, "
                 f"{tr['bytes'] / lines.GIB:.2f} GiB, {tr['seconds'] / tr['calls']:.3f} s a "
                 "call (its wait on the trainer included)")
  return out


def shown(process: runs_lib.Process, steps: int | None) -> list[dict[str, Any]]:
  """The records of `process` its table shows: its last `steps` (DEFAULT_STEPS unless given)."""
  n = DEFAULT_STEPS if steps is None else steps
  return process.records[len(process.records) - n:] if n else []


def as_json(run_: runs_lib.Run, steps: int | None) -> dict[str, Any]:
  return {"label": run_.label, "started": run_.started,
          "processes": [{"role": p.role, "host": p.host, "process": p.name, "run": p.run,
                         "started": p.started, "steps": len(p.records),
                         "records": shown(p, steps)} for p in run_.processes],
          "summary": analysis.summary(run_.trainer, run_.orchestrator)}


def run(args: argparse.Namespace) -> int:
  try:
    found, notes = runs_lib.runs(args.paths)
  except record_lib.RecordError as e:
    print(f"tunix-stage report: error: {e}", file=sys.stderr)
    return 2
  pair = comparable(args.paths, found)
  if pair is not None:
    pass  # the seam for `report A B`: the lead wires `return report_compare.run(args, *pair)`
  if args.json:
    print(json.dumps({"runs": [as_json(r, args.steps) for r in found], "notes": notes},
                     indent=2))
    return 0
  for note in notes:
    print(f"note: {note}")
  if len(found) > 1:
    print(f"{len(found)} runs (jobs) in these records, each reported apart; give one run's "
          "files to read it alone")
  for n, run_ in enumerate(found, start=1):
    print(f"run {n} of {len(found)}: {run_.label}" if len(found) > 1 else f"run: {run_.label}")
    _print_run(run_, args.steps)
  return 0


def _print_run(run_: runs_lib.Run, steps: int | None) -> None:
  for p in run_.processes:
    print(f"{p.role} {p.name} ({p.host}, {len(p.records)} steps)")
    records = shown(p, steps)
    if records:
      rows = trainer_rows if p.role == record_lib.TRAINER else orchestrator_rows
      for line in rows(records):
        print(f"  {line}")
    left = len(p.records) - len(records)
    if left and (steps is None or steps):
      print(f"  (the first {left} of its {len(p.records)} steps left out: --steps N shows the "
            "last N, --steps 0 the summary only)")
  summary = analysis.summary(run_.trainer, run_.orchestrator)
  print("overall (medians per step, a first step left out where there are others):")
  for line in overall_lines(summary):
    print(f"  {line}")
  recommendations = summary["recommendations"]
  print("recommendation: " + ("; ".join(recommendations) if recommendations else
                              "nothing to change: staging kept the trainer's input ready"))
