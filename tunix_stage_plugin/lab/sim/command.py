"""`tunix-stage simulate`: what staging would do to a job, from its recorded times
(docs/simulate.md)."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import Any

from tunix_stage_plugin import lab
from tunix_stage_plugin.lab.bench import modes as modes_lib
from tunix_stage_plugin.core import flags as flags_lib
from tunix_stage_plugin.lab import inputs

CHECK_TOLERANCE = 0.05  # --check: a prediction within 5 % of the measured median step
# --check on a --tiny bench: its steps last milliseconds, so its timings judge nothing (the label
# tunix-stage bench gives a --tiny run's timing checks, bench/report.TINY_NA).
TINY_NA = "n/a (tiny)"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
  parser = subparsers.add_parser(
      "simulate",
      help="predict what staging saves on a job from its recorded per-micro-batch times",
      description=textwrap.fill(
          "Run the plugin's real stage pipeline in virtual time against a model of the "
          "trainer's resources (one wire, one host-to-device engine, one device; the device and "
          "host bounds), fed by recorded per-micro-batch times, and print per mode the "
          "predicted step times, idle, hidden fraction and total saved. INPUT is a trace JSON "
          "or CSV (see examples/) or a tunix-stage bench JSON.", 78),
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=textwrap.dedent("""\
          trace JSON: {"steps": [{"update_s": U, "boundary_s": B,
                                  "microbatches": [{"wire_s": W, "h2d_s": H, "compute_s": C}, ...]}]}
          trace CSV:  step,microbatch,wire_s,h2d_s,compute_s[,update_s,boundary_s]
          a bench JSON: its emulated wire and host-to-device times and one mode's recorded
          fwd_bwd and update times (resident's: the device's own speed); --check predicts each
          mode of that bench from that mode's own recorded times and compares.
          The first step fills the pipeline (as the bench's warm-up); medians are over the rest."""),
  )
  parser.add_argument("input", metavar="INPUT", help="a trace JSON or CSV, or a bench JSON")
  parser.add_argument("--modes", default=None, metavar="LIST",
                      help=f"comma-separated modes (default: {','.join(modes_lib.DEFAULT_MODES)}); "
                      "depthN and depthN_prestage for other depths")
  parser.add_argument("--stage_max_device_batches", dest="max_device_batches", default="1", metavar="N",
                      help="the trainer's device bound (default 1)")
  parser.add_argument("--stage_max_host_batches", dest="max_host_batches", default="1", metavar="N",
                      help="the trainer's received-batch host bound (default 1)")
  parser.add_argument("--what_if", action="append", default=[], metavar="RESOURCE=Fx",
                      help="scale one resource's times, e.g. wire=0.5x (compression halving the "
                      "wire), h2d=2x, compute=0.8x; repeatable")
  parser.add_argument("--check", action="store_true",
                      help="INPUT is a bench JSON: predict each of its modes and compare with the "
                      + flags_lib.literal(f"measured median step (a prediction within "
                                          f"{CHECK_TOLERANCE:.0%} passes)"))
  parser.add_argument("--json", default=None, metavar="PATH",
                      help="also write the figures as JSON ('-': stdout, instead of the table)")
  parser.add_argument("--png", default=None, metavar="PATH",
                      help="a timeline picture of one step (--step) in every mode")
  parser.add_argument("--step", default="1", metavar="N",
                      help="the step the picture shows (default 1, the first after the fill)")
  parser.set_defaults(run=run)


def _what_if(text: str) -> tuple[str, float]:
  # pylint: disable-next=import-outside-toplevel
  from tunix_stage_plugin.lab.sim import trace as trace_lib
  resource, _, factor = text.partition("=")
  if resource not in trace_lib.RESOURCES:
    raise ValueError(f"accepted: RESOURCE=FACTOR with RESOURCE one of "
                     f"{', '.join(trace_lib.RESOURCES)}, e.g. wire=0.5x")
  return resource, inputs.positive(factor.removesuffix("x"))


def _modes(text: str) -> tuple[str, ...]:
  # pylint: disable-next=import-outside-toplevel
  from tunix_stage_plugin.lab.sim import run as run_lib
  modes = tuple(m.strip() for m in text.split(",") if m.strip())
  if not modes or len(set(modes)) != len(modes):
    raise ValueError("accepted: a comma-separated list of distinct modes")
  for mode in modes:
    run_lib.plan_of(mode)  # raises naming the accepted modes
  return modes


def run(args: argparse.Namespace) -> int:
  missing = lab.missing_line("simulate")
  if missing is not None:
    print(missing, file=sys.stderr)
    return 2
  # pylint: disable=import-outside-toplevel
  from tunix_stage_plugin.lab.sim import run as run_lib
  from tunix_stage_plugin.lab.sim import trace as trace_lib

  p = inputs.Problems()
  modes = p.take("--modes", args.modes, _modes) or modes_lib.DEFAULT_MODES
  device = p.take("--stage_max_device_batches", args.max_device_batches, inputs.count)
  host = p.take("--stage_max_host_batches", args.max_host_batches, inputs.count)
  step = p.take("--step", args.step, inputs.count)
  factors = dict(filter(None, (p.take("--what_if", w, _what_if) for w in args.what_if)))
  if args.json not in (None, "-"):
    p.check_path("--json", args.json, inputs.output_file_problem)
  if args.png is not None:
    p.check_path("--png", args.png, inputs.output_file_problem)
  if p:
    for line in p.lines:
      print(f"tunix-stage simulate: error: {line}", file=sys.stderr)
    return 2
  try:
    if args.check:
      bench, traces = _bench_traces(args.input, modes, factors)
    else:
      trace = trace_lib.load(args.input, mode="resident").scaled(factors)
      bench, traces = None, {m: trace for m in modes}
    if args.png is not None:
      _check_step(step, traces)  # before any simulation: bad input is refused up front
    if bench is not None:
      report = _check(args.input, bench, traces, device, host)
    else:
      report = _predict(trace, modes, device, host)
  except (trace_lib.TraceError, ValueError) as e:
    print(f"tunix-stage simulate: error: {e}", file=sys.stderr)
    return 2
  results = report.pop("_results")
  if args.json == "-":
    print(json.dumps(report, indent=1))
  else:
    print(_table(report))
    if args.json:
      with open(args.json, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
  if args.png:
    _picture(args.png, results, step)
  failed = [m for m, r in report["modes"].items() if r.get("within_tolerance") is False]
  return 1 if failed else 0


def _figures(result: Any, hidden: float | None, inline_total: float | None) -> dict[str, Any]:
  return {"predicted_median_step_s": result.median_step_s, "step_s": result.step_s,
          "mid_step_idle_s": result.mid_step_idle_s, "boundary_idle_s": result.boundary_idle_s,
          "hidden_fraction": hidden, "total_s": result.total_s,
          "saved_s": None if inline_total is None else inline_total - result.total_s,
          "fallbacks": result.fallbacks}


def _predict(trace: Any, modes: tuple[str, ...], device: int, host: int) -> dict[str, Any]:
  from tunix_stage_plugin.lab.sim import run as run_lib  # pylint: disable=import-outside-toplevel
  results = {m: run_lib.simulate(trace, m, max_device_batches=device, max_host_batches=host)
             for m in modes}
  hidden = run_lib.hidden_fractions(results)
  inline_total = results["inline"].total_s if "inline" in results else None
  micro = sum(len(s.microbatches) for s in trace.steps)
  return {"input": trace.source, "steps": len(trace.steps), "microbatches": micro,
          "max_device_batches": device, "max_host_batches": host,
          "modes": {m: _figures(r, hidden[m], inline_total) for m, r in results.items()},
          "_results": results}


def _check_step(step: int, traces: dict[str, Any]) -> None:
  """--step names a step after the fill (step 0) that every mode's trace has."""
  from tunix_stage_plugin.lab.sim import trace as trace_lib  # pylint: disable=import-outside-toplevel
  last = min(len(t.steps) for t in traces.values()) - 1
  if last >= 1 and step > last:  # (a trace of one step is refused by the simulator itself)
    raise trace_lib.TraceError(f"--step {step}: accepted: a step from 1 to {last} (the trace's "
                               f"steps after the fill, step 0)")


def _bench_traces(path: str, modes: tuple[str, ...], factors: dict[str, float]
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
  """--check's input: the bench JSON and, per mode it measured, that mode's recorded times."""
  from tunix_stage_plugin.lab.sim import trace as trace_lib  # pylint: disable=import-outside-toplevel
  bench = trace_lib.read_json(path)
  if not isinstance(bench, dict) or not isinstance(bench.get("modes"), dict):
    raise trace_lib.TraceError(f"{path}: not a tunix-stage bench JSON (no modes); accepted with "
                               "--check: a bench JSON (bench-out/bench.json)")
  modes = tuple(m for m in modes if m in bench["modes"])
  if not modes:
    raise trace_lib.TraceError(f"{path}: no mode of this bench to check against")
  traces = {}
  for mode in modes:
    timed = trace_lib.from_bench(bench, mode, path).scaled(factors)
    # The bench's warm-up step is not recorded: its first timed step stands in for it.
    traces[mode] = trace_lib.Trace((timed.steps[0], *timed.steps), timed.source)
  return bench, traces


def _check(path: str, bench: dict[str, Any], traces: dict[str, Any], device: int,
           host: int) -> dict[str, Any]:
  from tunix_stage_plugin.lab.sim import run as run_lib  # pylint: disable=import-outside-toplevel
  measured = bench["modes"]
  options = bench.get("options") or {}
  device = options.get("max_device_batches", device)
  host = options.get("max_host_batches", host)
  tiny = bool(options.get("tiny"))  # milliseconds of compute: nothing to judge
  results = {mode: run_lib.simulate(trace, mode, max_device_batches=device,
                                    max_host_batches=host) for mode, trace in traces.items()}
  hidden = run_lib.hidden_fractions(results)
  report_modes = {}
  for mode, result in results.items():
    figures = _figures(result, hidden[mode], None)
    want = measured[mode]["median_step_s"]
    error = result.median_step_s / want - 1.0
    figures.update(measured_median_step_s=want, error=error,
                   within_tolerance=None if tiny else abs(error) <= CHECK_TOLERANCE)
    report_modes[mode] = figures
  return {"input": path, "check": True, "tolerance": CHECK_TOLERANCE, "tiny": tiny,
          "max_device_batches": device, "max_host_batches": host, "modes": report_modes,
          "_results": results}


def _verdict(report: dict[str, Any], figures: dict[str, Any]) -> str:
  if figures["within_tolerance"] is None:
    return TINY_NA
  return "ok" if figures["within_tolerance"] else f"OFF by more than {report['tolerance']:.0%}"


def _fmt(value: float | None, spec: str) -> str:
  return "-" if value is None else format(value, spec)


def _table(report: dict[str, Any]) -> str:
  check = report.get("check", False)
  header = (("mode", "predicted step s", "measured step s", "error", "") if check else
            ("mode", "step s", "mid-step idle s", "boundary idle s", "hidden", "total s",
             "saved s"))
  rows = []
  for mode, r in report["modes"].items():
    if check:
      rows.append((mode, _fmt(r["predicted_median_step_s"], ".3f"),
                   _fmt(r["measured_median_step_s"], ".3f"), f"{r['error']:+.1%}",
                   _verdict(report, r)))
    else:
      mid = sorted(r["mid_step_idle_s"])[len(r["mid_step_idle_s"]) // 2]
      boundary = sorted(r["boundary_idle_s"])[len(r["boundary_idle_s"]) // 2]
      rows.append((mode, _fmt(r["predicted_median_step_s"], ".2f"), _fmt(mid, ".2f"),
                   _fmt(boundary, ".2f"), _fmt(r["hidden_fraction"], ".2f"),
                   _fmt(r["total_s"], ".1f"), _fmt(r["saved_s"], ".1f")))
  widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
  lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                     enumerate(zip(row, widths))).rstrip() for row in (header, *rows)]
  lines.insert(1, "  ".join("-" * w for w in widths).rstrip())
  title = (f"tunix-stage simulate --check {report['input']}: predicted vs measured median step"
           + ("; a --tiny bench: its model computes in milliseconds, so its timings judge "
              "nothing (n/a)" if report.get("tiny") else "")
           if check else
           f"tunix-stage simulate {report['input']}: {report['steps']} steps, "
           f"{report['microbatches']} micro-batches; device bound {report['max_device_batches']}, "
           f"host bound {report['max_host_batches']}; medians over steps 1.. (step 0 fills the "
           "pipeline); saved = inline total - mode total")
  return "\n".join([title, "", *lines])


class _Picture:
  """What bench.plot draws for a run: one step's window of a simulated mode."""

  def __init__(self, mode: str, result: Any, step: int) -> None:
    from tunix_stage_plugin.core import tracks  # pylint: disable=import-outside-toplevel
    ends = {dict(s.args)["step"]: s.end for s in result.spans
            if s.track == tracks.DEVICE_COMPUTE and dict(s.args).get("kind") == "update"}
    self.mode, self.round = mode, 0
    self.origin = ends.get(step - 1, 0.0)
    end = ends[step]
    self.spans = [s for s in result.spans if s.end > self.origin and s.start < end]
    self.timings = [t for t in result.timings if t.step == step]


def _picture(path: str, results: dict[str, Any], step: int) -> None:
  from tunix_stage_plugin.lab.bench import plot  # pylint: disable=import-outside-toplevel
  assert step <= min(len(r.step_s) for r in results.values()), step  # run() checked it
  try:
    plot.write_timeline_png(path, [_Picture(m, r, step) for m, r in results.items()],
                            title=f"tunix-stage simulate: step {step}, predicted")
  except plot.PlotUnavailable as e:
    print(f"tunix-stage simulate: warning: {e}", file=sys.stderr)
