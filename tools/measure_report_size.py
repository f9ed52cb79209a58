"""How long `tunix-stage report` takes, and how much memory, on a long job's records.

Writes a synthetic job's metrics records (a trainer's and an orchestrator's, STEPS steps each)
through the plugin's own record.make and record.Writer, then times `tunix-stage report` on them in
a subprocess: its wall time, its CPU time (what a machine shared with other work changes least)
and its peak resident memory (os.wait4: each report's own figures).

  python tools/measure_report_size.py --steps 200000 -- --steps 0
  python tools/measure_report_size.py --steps 200000 --keep /tmp/r -- --json --steps 0
  python tools/measure_report_size.py --record /tmp/r --tree /other/checkout --version 1 --
  python tools/measure_report_size.py --record /tmp/r --tree /old --tree . --runs 3 -- --steps 0
  python tools/measure_report_size.py --record /tmp/r --phases

--version 1 writes the records as version 1 did (no run), so an older checkout's report
(--tree: the checkout whose package is timed; several: each in turn, back to back) reads the
same records; --runs N times each tree N times and ends with each tree's medians. --phases times
the parts of a report alone, in this process, with this checkout (where the time goes).
docs/observability.md "tunix-stage report".
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from tunix_stage_plugin.core.telemetry import record as record_lib

MIB = 1 << 20
STEP_S = 2.5  # about the steps' length (trainer_figures'): their records' times are this apart


def trainer_figures(step: int, rng: random.Random) -> dict:
  """A staged trainer step of 4 micro-batches of 64 MiB, its times drawn around 2.5 s."""
  fwd = [rng.uniform(0.5, 0.6) for _ in range(4)]
  receive = [rng.uniform(0.2, 0.3) for _ in range(4)]
  place = rng.uniform(0.02, 0.05)
  wait = rng.choice([0.0, 0.0, 0.0, rng.uniform(0.0, 0.2)])
  return {
      "step": step, "host_step": step + 1, "step_s": None if step == 0 else sum(fwd) + 0.3 + wait,
      "compute_s": sum(fwd) + 0.2,
      "input_wait_s": {"mid_step": wait, "boundary": None if step == 0 else rng.uniform(0, 0.01)},
      "other_s": 0.1, "microbatches": 4,
      "compute": {"fwd_bwd_median_s": sorted(fwd)[2], "update_s": 0.2, "alone_s": 0.5,
                  "beside_transfer": 4, "slowdown_s": rng.uniform(0.0, 0.05)},
      "receive": {"calls": 4, "bytes": 4 * 64 * MIB, "seconds": sum(receive),
                  "by_transport": {"side": {"calls": 4, "bytes": 4 * 64 * MIB,
                                            "seconds": sum(receive)}}},
      "place": {"count": 4, "seconds": 4 * place, "bytes": 4 * 64 * MIB, "staged": 4,
                "inline": 0},
      "pool": {"waits": 0, "wait_s": 0.0, "over_bound": 0},
      "staged": {"peak_device": 1, "peak_host": 1},
      "bound_by": "wire" if wait > 0.13 else "compute"}


def orchestrator_figures(step: int, rng: random.Random) -> dict:
  calls = [rng.uniform(0.2, 0.3) for _ in range(4)]
  return {
      "step": step, "step_s": None if step == 0 else rng.uniform(2.4, 2.7), "microbatches": 4,
      "depth": 2, "staged": 4, "inline": 0, "prestaged": 1, "peak_staged": 2,
      "fallbacks": {"count": 0, "by_kind": {}},
      "sent": {"side": {"calls": 4, "bytes": 4 * 64 * MIB, "seconds": sum(calls),
                        "gib_s": 0.25 / (sum(calls) / 4)}},
      "stage_calls": {"count": 3, "seconds": sum(calls[1:]), "median_s": sorted(calls)[2],
                      "max_s": max(calls)}}


def write(folder: str, steps: int, version: int) -> None:
  rng = random.Random(42)
  run = record_lib.new_run()
  settings = {"max_staged_batches": 2, "max_device_batches": 1, "max_host_batches": 1}
  for role, figures in ((record_lib.TRAINER, trainer_figures),
                        (record_lib.ORCHESTRATOR, orchestrator_figures)):
    writer = record_lib.Writer(folder, role, run["id"])
    for step in range(steps):
      rec = record_lib.make(role, "tunix", figures(step, rng), settings, run)
      rec["time"] = run["started"] + STEP_S * (step + 1)  # as the job's steps end, not as written
      if version == 1:  # as version 1 wrote it: no run
        del rec["run"]
        rec["version"] = 1
      writer.write(rec)
    writer.close()


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
  parser.add_argument("--steps", type=int, default=200_000, help="steps per process")
  parser.add_argument("--record", help="time the report on this folder's records (written "
                      "before) instead of writing new ones")
  parser.add_argument("--keep", help="write the records into this folder and keep them")
  parser.add_argument("--version", type=int, default=record_lib.VERSION, choices=(1, 2))
  parser.add_argument("--tree", action="append", help="a checkout whose report is timed (its "
                      "PYTHONPATH); again for another, timed in turn")
  parser.add_argument("--runs", type=int, default=1, help="times each tree's report is timed")
  parser.add_argument("--phases", action="store_true", help="time the report's parts instead")
  parser.add_argument("report_args", nargs="*", help="after --: the report's own flags")
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory() as scratch:
    folder = args.record or args.keep or scratch
    if args.record is None:
      start = time.perf_counter()
      write(folder, args.steps, args.version)
      print(f"wrote {args.steps} steps x 2 processes (version {args.version}) in "
            f"{time.perf_counter() - start:.1f} s: {folder}", flush=True)
    if args.phases:
      print(json.dumps(phases(folder)))
      return 0
    timed = [time_report(folder, tree, args.report_args)
             for _ in range(args.runs) for tree in args.tree or [None]]
  for row in timed:
    print(json.dumps(row))
  if args.runs > 1:
    for tree in dict.fromkeys(row["tree"] for row in timed):
      rows = [row for row in timed if row["tree"] == tree]
      print(json.dumps({"tree": tree, "runs": len(rows), "median": {
          key: statistics.median(row[key] for row in rows)
          for key in ("wall_s", "cpu_s", "peak_rss_mib", "load_1min")}}))
  return max(row["exit"] for row in timed)


def time_report(folder: str, tree: str | None, report_args: list[str]) -> dict:
  """One `tunix-stage report` on `folder` in a subprocess (with `tree`'s package): its figures."""
  size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
  env = dict(os.environ)
  if tree:  # its package first (`-m` puts the working folder first: run it there), then any
    # PYTHONPATH given
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p)
  cmd = [sys.executable, "-m", "tunix_stage_plugin", "report", os.path.abspath(folder),
         *report_args]
  with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=tree, stdout=stdout, stderr=stderr)  # pylint: disable=consider-using-with
    _, status, usage = os.wait4(proc.pid, 0)  # this report's own figures
    wall = time.perf_counter() - start
    stdout.seek(0)
    stderr.seek(0)
    out, err = stdout.read().decode(errors="replace"), stderr.read().decode(errors="replace")
  return {"command": " ".join(["tunix-stage report DIR", *report_args]),
          "tree": tree or "this checkout", "record_mib": round(size / MIB, 1),
          "exit": os.waitstatus_to_exitcode(status), "wall_s": round(wall, 2),
          "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
          "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
          "load_1min": round(os.getloadavg()[0], 2),
          "stdout_lines": out.count("\n"), "stdout_mib": round(len(out) / MIB, 2),
          "stderr_tail": err[-300:]}


def phases(folder: str) -> dict:
  """The CPU seconds of a report's parts on `folder`, each timed alone, and the resident memory
  after each (MiB): importing the reading layer (pandas, pyarrow), reading the records into
  their tables (pyarrow's JSON reader and the columns' check), telling the runs apart, the
  summary and the advice (of the first run)."""
  out = {}

  def timed(name, fn):
    start = time.process_time()
    result = fn()
    out[name + "_s"] = round(time.process_time() - start, 2)
    with open("/proc/self/statm", encoding="ascii") as f:
      out[name + "_rss_mib"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // MIB
    return result

  # pylint: disable=import-outside-toplevel
  reading = timed("import", lambda: __import__("tunix_stage_plugin.reading.report").reading)
  found = timed("read", lambda: reading.records.read([folder]))
  run = timed("runs", lambda: reading.runs.of(found))[0]
  timed("summary", lambda: reading.summary.summary(run.trainer_steps, run.orchestrator_steps))
  timed("advice", lambda: reading.report.checked_advice(run))
  return out


if __name__ == "__main__":
  sys.exit(main())
