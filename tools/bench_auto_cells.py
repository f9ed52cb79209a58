#!/usr/bin/env python3
"""The bench cells that judge `auto` as the default (docs/performance.md "auto as the default"):
each host (embedded, tunix) x micro-batch size (16 MiB, 1 GiB), INVOCATIONS invocations of
`tunix-stage bench --modes inline,depth1,depth2,depth2_prestage,auto --rounds 1 --steps 4`; then,
per cell, each mode's median over the invocations of their median step and its run-to-run spread
(the invocations' lowest to highest), and whether auto's median is within the best fixed mode's
spread and never above the fixed default's (depth2_prestage: depth 2, prestaging, host bound 1).

Run it alone on the machine (the timings are the point); it takes about 30 minutes on a
2-core machine. Each invocation's bench JSON is kept in OUT (default bench-auto-cells/), and the table
(markdown) and verdicts go to stdout and OUT/cells.json. An invocation that fails is said and
left out of its cell (a cell with none judges nothing).

  tools/bench_auto_cells.py                          # every cell, 3 invocations each
  tools/bench_auto_cells.py --hosts embedded --payloads 1 --invocations 1 --quick  # a try

The embedded host runs with this checkout's .venv (or $PYTHON); tunix's with $TUNIX_VENV's python
(`eval "$(tools/host_venvs.sh --print-paths ../shared/hosts/tunix-c7d8950.tar.gz)"` sets it),
this checkout first on its PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("inline", "depth1", "depth2", "depth2_prestage", "auto")
FIXED = ("depth1", "depth2", "depth2_prestage")  # the fixed staged modes auto is judged against
DEFAULT = "depth2_prestage"  # the fixed default: depth 2, prestaging, host bound 1


def python_for(host: str) -> str:
  if host == "tunix":
    venv = os.environ.get("TUNIX_VENV")
    if not venv:
      sys.exit("bench_auto_cells: error: TUNIX_VENV is not set: the tunix host runs in the venv "
               "tools/host_venvs.sh builds (eval \"$(tools/host_venvs.sh --print-paths "
               "../shared/hosts/tunix-c7d8950.tar.gz)\")")
    return str(Path(venv) / "bin" / "python")
  if os.environ.get("PYTHON"):
    return os.environ["PYTHON"]
  local = ROOT / ".venv" / "bin" / "python"
  return str(local) if local.exists() else sys.executable


def bench(host: str, payload_mib: int, index: int, args: argparse.Namespace) -> dict | None:
  """One invocation: its bench JSON, or None where it failed (said)."""
  out = Path(args.out) / f"{host}-{payload_mib}mib-{index}.json"
  cmd = [python_for(host), "-m", "tunix_stage_plugin", "bench", "--host", host,
         "--payload_mib", str(payload_mib), "--modes", ",".join(args.modes),
         "--json", str(out), "--png", "", "--trace", "", "--quiet"]
  cmd += ["--quick"] if args.quick else ["--rounds", "1", "--steps", "4"]
  cmd += args.bench_args
  env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
  env = {k: v for k, v in env.items() if not (k.startswith("TUNIX_") and k != "TUNIX_VENV")}
  started = time.monotonic()
  print(f"bench_auto_cells: {host} {payload_mib} MiB, invocation {index + 1}: {' '.join(cmd)}",
        file=sys.stderr, flush=True)
  proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
  if proc.returncode != 0 or not out.exists():
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    print(f"bench_auto_cells: {host} {payload_mib} MiB invocation {index + 1} failed (exit "
          f"{proc.returncode}): {' | '.join(tail)}", file=sys.stderr, flush=True)
    return None
  print(f"bench_auto_cells: done in {time.monotonic() - started:.0f} s", file=sys.stderr,
        flush=True)
  return json.loads(out.read_text())


def cell(runs: list[dict], modes: tuple[str, ...]) -> dict:
  """Per mode, the invocations' median steps, their median and spread; the verdicts."""
  by_mode = {m: [r["modes"][m]["median_step_s"] for r in runs if m in r.get("modes", {})]
             for m in modes}
  figures = {m: {"invocations": v, "median": statistics.median(v), "low": min(v), "high": max(v)}
             for m, v in by_mode.items() if v}
  out: dict = {"modes": figures, "invocations": len(runs)}
  fixed = [m for m in FIXED if m in figures]
  if "auto" in figures and fixed:
    best = min(fixed, key=lambda m: figures[m]["median"])
    auto = figures["auto"]["median"]
    out["best_fixed"] = best
    out["auto_over_best"] = auto / figures[best]["median"]
    out["within_best_spread"] = auto <= figures[best]["high"]
    if DEFAULT in figures:
      out["within_default_spread"] = auto <= figures[DEFAULT]["high"]
    out["auto_choices"] = [[c["depth"] for c in run["choices"]] for r in runs
                           for run in r.get("runs", []) if run["mode"] == "auto"
                           and run.get("choices")]
  return out


def table(cells: dict[str, dict], modes: tuple[str, ...]) -> str:
  head = ("| host, micro-batch | " + " | ".join(modes) + " | auto / best fixed | within the best"
          " fixed's spread | within depth2_prestage's spread |")
  lines = [head, "|" + "---|" * (len(modes) + 4)]
  for name, c in cells.items():
    f = c["modes"]
    values = [f"{f[m]['median']:.2f} ({f[m]['low']:.2f}-{f[m]['high']:.2f})" if m in f else "-"
              for m in modes]
    judged = [f"{c['auto_over_best']:.2f} ({c['best_fixed']})" if "best_fixed" in c else "-",
              _yes(c.get("within_best_spread")), _yes(c.get("within_default_spread"))]
    lines.append(f"| {name} | " + " | ".join(values + judged) + " |")
  return "\n".join(lines)


def _yes(value: bool | None) -> str:
  return "-" if value is None else ("yes" if value else "NO")


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog=__doc__.split("\n\n", 1)[1])
  parser.add_argument("--hosts", default="embedded,tunix")
  parser.add_argument("--payloads", default="16,1024", help="micro-batch sizes, MiB")
  parser.add_argument("--invocations", type=int, default=3)
  parser.add_argument("--modes", default=",".join(MODES))
  parser.add_argument("--out", default="bench-auto-cells")
  parser.add_argument("--quick", action="store_true",
                      help="each invocation --quick (a try of the tool; its timings judge nothing)")
  parser.add_argument("bench_args", nargs="*", help="more bench flags, after --")
  args = parser.parse_args()
  args.modes = tuple(args.modes.split(","))
  Path(args.out).mkdir(parents=True, exist_ok=True)
  cells = {}
  for host in args.hosts.split(","):
    for payload in (int(p) for p in args.payloads.split(",")):
      runs = [r for r in (bench(host, payload, i, args) for i in range(args.invocations)) if r]
      name = f"{host}, {payload // 1024} GiB" if payload >= 1024 else f"{host}, {payload} MiB"
      if runs:
        cells[name] = cell(runs, args.modes)
  (Path(args.out) / "cells.json").write_text(json.dumps(cells, indent=2))
  print("medians over the invocations of each one's median step, seconds (lowest-highest)")
  print(table(cells, args.modes))
  return 0 if cells else 1


if __name__ == "__main__":
  sys.exit(main())
