"""`tunix-stage bench`: the staging A/B on the embedded host, on any machine."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the bench modules load grpc; `tunix-stage --help` should not wait for that
  from tunix_stage_plugin.bench import runner

DEFAULT_OUT = "bench-out"
QUICK = {"rounds": 1, "steps": 2}
FULL = {"rounds": 3, "steps": 2}


def _modes(text: str) -> tuple[str, ...]:
  from tunix_stage_plugin.bench import runner  # pylint: disable=import-outside-toplevel

  modes = tuple(m.strip() for m in text.split(",") if m.strip())
  bad = [m for m in modes if m not in runner.MODES]
  if bad or not modes:
    raise argparse.ArgumentTypeError(f"{text!r}: accepted a comma-separated subset of "
                                     f"{','.join(runner.MODES)}")
  return modes


def _positive_int(text: str) -> int:
  if not (text.isascii() and text.isdigit()) or int(text) < 1:
    raise argparse.ArgumentTypeError(f"{text!r}: accepted an integer >= 1")
  return int(text)


def _positive_float(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    value = -1.0
  if not value > 0 or value == float("inf"):
    raise argparse.ArgumentTypeError(f"{text!r}: accepted a number > 0")
  return value


def _nonnegative_float(text: str) -> float:
  return 0.0 if text.strip() in ("0", "0.0") else _positive_float(text)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
  parser = subparsers.add_parser(
      "bench",
      help="run the staging A/B (inline, depth1, depth2, depth2_prestage, resident)",
      description=textwrap.fill(
          "Run the staging A/B on the embedded host: a JAX trainer process serving gRPC on "
          "127.0.0.1, an orchestrator driving it through the stage pipeline, and emulated links "
          "calibrated to production's proportions (wire 0.8 x and host-to-device 0.4 x the "
          "compute of one micro-batch). The modes alternate in rounds; the table reports medians. "
          "Writes a JSON report, a PNG timeline and a Chrome/Perfetto trace.", 78) + "\n\n" +
      textwrap.fill(
          "Exit 0 when the run completed and every correctness check passed (a timing check "
          "fails the exit code only with --strict), 1 otherwise, 2 for bad options.", 78),
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="modes:\n"
      "  inline           every micro-batch travels with its train call; nothing staged\n"
      "  depth1, depth2   up to 1 or 2 micro-batches staged ahead of the pending train call\n"
      "  depth2_prestage  depth2, and the next step's first micro-batches stage across the\n"
      "                   step boundary (update + weight sync)\n"
      "  resident         all micro-batches on the device before the first step: the ceiling\n"
      "\nhidden fraction = (T_inline - T_mode) / (T_inline - T_resident)",
  )
  size = parser.add_argument_group("run length")
  size.add_argument("--quick", action="store_true",
                    help=f"short run (about a minute): {QUICK['rounds']} round of {QUICK['steps']} "
                    "timed steps per mode unless --rounds/--steps say otherwise")
  size.add_argument("--rounds", type=_positive_int, default=None, metavar="N",
                    help=f"rounds; each runs every mode once, rotating the order "
                    f"(default {FULL['rounds']}, --quick {QUICK['rounds']})")
  size.add_argument("--steps", type=_positive_int, default=None, metavar="N",
                    help=f"timed steps per mode run, after one warm-up step "
                    f"(default {FULL['steps']})")
  size.add_argument("--retries", type=int, default=3, metavar="N",
                    help="re-run a mode run in which other processes used more than 0.2 cores "
                    "during every timed step, at most N times in all (default 3; 0: never)")
  size.add_argument("--modes", type=_modes, default=None, metavar="LIST",
                    help="comma-separated modes to run (default: all five)")
  shape = parser.add_argument_group("workload and emulated links")
  shape.add_argument("--microbatches", type=_positive_int, default=4, metavar="M",
                     help="micro-batches per step (default 4)")
  shape.add_argument("--payload-mib", type=_positive_float, default=16.0, metavar="MIB",
                     help="bytes of one micro-batch, in MiB (default 16); sets only the real bytes "
                     "copied, the emulated times follow the ratios")
  shape.add_argument("--wire-ratio", type=_positive_float, default=0.8, metavar="X",
                     help="wire time of one micro-batch as a multiple of its compute (default 0.8)")
  shape.add_argument("--h2d-ratio", type=_positive_float, default=0.4, metavar="X",
                     help="host-to-device time as a multiple of compute (default 0.4)")
  shape.add_argument("--sync-ratio", type=_nonnegative_float, default=0.5, metavar="X",
                     help="the step boundary's weight sync as a multiple of compute (default 0.5)")
  shape.add_argument("--max-device-batches", type=_positive_int, default=2, metavar="N",
                     help="the trainer's device bound (TUNIX_STAGE_MAX_DEVICE_BATCHES) for every "
                     "mode (default 2: depth2 may hold two staged batches)")
  shape.add_argument("--seed", type=int, default=0, help="parameters and data seed (default 0)")
  shape.add_argument("--tiny", action="store_true",
                     help="a tiny model for smoke tests; its timing figures mean nothing")
  out = parser.add_argument_group("output")
  out.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"folder for bench.json, timeline.png and trace.json "
                   f"(default {DEFAULT_OUT})")
  out.add_argument("--json", default=None, metavar="PATH",
                   help="JSON report (default DIR/bench.json)")
  out.add_argument("--png", default=None, metavar="PATH",
                   help="timeline picture of the last round (default DIR/timeline.png; '' skips)")
  out.add_argument("--trace", default=None, metavar="PATH",
                   help="Chrome/Perfetto trace of every run (default DIR/trace.json; '' skips)")
  out.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
  out.add_argument("--strict", action="store_true",
                   help="exit 1 when a timing check fails, too")
  parser.set_defaults(run=run)


def _options(args: argparse.Namespace) -> runner.BenchOptions:
  # pylint: disable-next=import-outside-toplevel,redefined-outer-name
  from tunix_stage_plugin.bench import runner

  length = QUICK if args.quick else FULL
  return runner.BenchOptions(
      rounds=args.rounds or length["rounds"], steps=args.steps or length["steps"],
      microbatches=args.microbatches, payload_mib=args.payload_mib, wire_ratio=args.wire_ratio,
      h2d_ratio=args.h2d_ratio, sync_ratio=args.sync_ratio,
      max_device_batches=args.max_device_batches, modes=args.modes or runner.MODES,
      seed=args.seed, tiny=args.tiny, retries=args.retries)


def run(args: argparse.Namespace) -> int:
  os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
  # pylint: disable=import-outside-toplevel  (keep `tunix-stage --help` fast)
  from tunix_stage_plugin.bench import plot
  from tunix_stage_plugin.bench import report
  from tunix_stage_plugin.bench import runner  # pylint: disable=redefined-outer-name
  from tunix_stage_plugin.bench import trace
  from tunix_stage_plugin.embedded import client
  from tunix_stage_plugin.embedded import process

  try:
    options = _options(args)
  except ValueError as e:
    print(f"tunix-stage bench: error: {e}", file=sys.stderr)
    return 2
  files = {
      "json": args.json if args.json is not None else os.path.join(args.out, "bench.json"),
      "png": args.png if args.png is not None else os.path.join(args.out, "timeline.png"),
      "trace": args.trace if args.trace is not None else os.path.join(args.out, "trace.json"),
  }
  files = {k: v for k, v in files.items() if v}
  for path in files.values():
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)

  def progress(line: str) -> None:
    if not args.quiet:
      print(line, file=sys.stderr, flush=True)

  try:
    result = runner.run_bench(options, progress)
  except (process.TrainerProcessError, *client.CALL_ERRORS) as e:
    print(f"tunix-stage bench: error: {client.describe_call_error(e, 'the trainer process')}",
          file=sys.stderr)
    return 1
  summary = report.summarize(result)
  checks = report.criteria(result, summary)
  last_round = list(runner.runs_of_round(result).values())
  if "png" in files:
    try:
      plot.write_timeline_png(files["png"], last_round,
                              title="tunix-stage bench: device compute and staging per mode")
    except plot.PlotUnavailable as e:
      print(f"tunix-stage bench: warning: {e}", file=sys.stderr)
      del files["png"]
  if "trace" in files:
    trace.write_trace(files["trace"], result.runs)
  if "json" in files:
    with open(files["json"], "w", encoding="utf-8") as f:
      json.dump(report.to_json(result, summary, checks, files), f, indent=1)
  print(report.format_report(result, summary, checks))
  print("wrote " + ", ".join(files.values()) + f" ({result.wall_s:.0f} s)")
  failed = [c for c in checks
            if c.passed is False and (c.kind == report.CORRECTNESS or args.strict)]
  if result.trainer_exit_code != 0:
    print(f"tunix-stage bench: error: the trainer exited with code {result.trainer_exit_code}",
          file=sys.stderr)
    return 1
  return 1 if failed else 0
