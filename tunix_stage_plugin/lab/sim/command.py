"""`tunix-stage simulate`: what staging would do to a job, from its recorded times
(docs/simulate.md)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
from typing import Any

from tunix_stage_plugin import lab
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import flags as flags_lib
from tunix_stage_plugin.core import inputs as core_inputs
from tunix_stage_plugin.lab import inputs
from tunix_stage_plugin.lab.bench import modes as modes_lib
from tunix_stage_plugin.lab.sim import trace as trace_lib

CHECK_TOLERANCE = 0.05  # --check: a prediction within 5 % of the measured median step
MAX_FACTOR = 1000.0  # --what_if: a resource 1000 times slower is past any what-if
# --check on a --tiny bench: its steps last milliseconds, so its timings judge nothing (the label
# tunix-stage bench gives a --tiny run's timing checks, bench/report.TINY_NA).
TINY_NA = "n/a (tiny)"


def add_parser(subparsers: argparse._SubParsersAction, help_line: str) -> None:
  """The subcommand's parser; `help_line` is what `tunix-stage --help` shows (cli.main's table)."""
  parser = subparsers.add_parser(
      "simulate",
      help=help_line,
      description=textwrap.fill(
          "Run the plugin's real stage pipeline in virtual time against a model of the "
          "trainer's resources (one wire, one host-to-device engine, one device; the device and "
          "host bounds), fed by recorded per-micro-batch times, and print per mode the "
          "predicted step times, idle, hidden fraction and total saved. INPUT is a trace JSON "
          "or CSV, a tunix-stage bench JSON or its trace.json (examples/ holds one of each "
          "JSON kind), or a job's metrics record (the folder TUNIX_STAGE_METRICS named, or one "
          "of its .jsonl files).", 78),
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=textwrap.dedent("""\
          trace JSON: {"steps": [{"update_s": U, "boundary_s": B,
                                  "microbatches": [{"wire_s": W, "h2d_s": H, "compute_s": C}, ...]}]}
          trace CSV:  step,microbatch,wire_s,h2d_s,compute_s[,update_s,boundary_s]
          a metrics record: each trainer step as the trainer measured it (per micro-batch its
          median fwd_bwd, its receives' and placements' mean times; docs/observability.md).
          a bench JSON: its emulated wire and host-to-device times and one mode's recorded
          fwd_bwd and update times over the steps its medians counted (resident's: the device's
          own speed); --check predicts each mode of that bench from that mode's own recorded
          times and compares.
          The first step fills the pipeline (as the bench's warm-up); medians are over the rest.
          """) + textwrap.fill(
              f"Bounds: at most {trace_lib.MAX_MICROBATCHES} micro-batches and "
              f"{trace_lib.MAX_TOTAL_S:g} s of recorded time (after --what_if), a file of at most "
              f"{trace_lib.MAX_INPUT_BYTES >> 20} MiB; a simulation takes time in proportion to its "
              "micro-batches and modes (docs/simulate.md).", 88),
  )
  parser.add_argument("input", metavar="INPUT",
                      help="a trace JSON or CSV, a bench JSON or its trace.json, or a metrics "
                      "record (a TUNIX_STAGE_METRICS folder or .jsonl file)")
  parser.add_argument("--modes", default=None, metavar="LIST",
                      help=f"comma-separated modes (default: {','.join(modes_lib.DEFAULT_MODES)}); "
                      "depthN and depthN_prestage for other depths; auto (autoN) sizes the depth "
                      "each step within 4 (N) micro-batches")
  for field, bound in (("max_device_batches", "device"), ("max_host_batches", "received-batch host")):
    setting = config_lib.SETTINGS_BY_FIELD[field]
    parser.add_argument(f"--{setting.flag}", dest=field, default=None, metavar="N",
                        help=f"the trainer's {bound} bound ({setting.env}'s {setting.accepted}; "
                        f"default: {setting.env} where set, else "
                        f"{config_lib.fixed(field, setting.default)}; with "
                        "--check, the bench's own)")
  parser.add_argument("--what_if", action="append", default=[], metavar="RESOURCE=Fx",
                      help="scale one resource's times, e.g. wire=0.5x (compression halving the "
                      f"wire), h2d=2x, compute=0.8x (F > 0 and <= {MAX_FACTOR:g}); once per "
                      "resource, not with --check; the table, the JSON and the picture say it")
  parser.add_argument("--check", action="store_true",
                      help="INPUT is a bench JSON: predict each of its modes from the steps its "
                      "median counted (its quiet steps; a run re-run on a busy machine left out) "
                      + flags_lib.literal(f"and compare with that median (a prediction within "
                                          f"{CHECK_TOLERANCE:.0%} passes)"))
  parser.add_argument("--json", default=None, metavar="PATH",
                      help="also write the figures as JSON ('-': stdout, instead of the table)")
  parser.add_argument("--png", default=None, metavar="PATH",
                      help="a timeline picture of one step (--step) in every mode")
  parser.add_argument("--step", default=None, metavar="N",
                      help="with --png, the step it shows (default 1, the first after the fill)")
  parser.set_defaults(run=run)


def _what_if(text: str) -> tuple[str, float]:
  accepted = (f"RESOURCE=F or RESOURCE=Fx with RESOURCE one of {', '.join(trace_lib.RESOURCES)} "
              f"and F a number > 0 and <= {MAX_FACTOR:g}, e.g. wire=0.5x")
  resource, _, factor = text.partition("=")
  if resource not in trace_lib.RESOURCES:
    raise inputs.Refused(accepted)
  try:
    return resource, inputs.number(factor.removesuffix("x"), above=0.0, at_most=MAX_FACTOR)
  except inputs.Refused:
    raise inputs.Refused(accepted) from None


def _modes(text: str) -> tuple[str, ...]:
  # pylint: disable-next=import-outside-toplevel
  from tunix_stage_plugin.lab.sim import run as run_lib
  modes = tuple(m.strip() for m in text.split(",") if m.strip())
  if not modes or len(set(modes)) != len(modes):
    raise inputs.Refused(f"a comma-separated list of distinct modes: {run_lib.MODES_ACCEPTED}")
  for mode in modes:
    run_lib.plan_of(mode)  # raises naming the accepted modes
  return modes


def _bound(p: inputs.Problems, field: str, flag: str | None, check: bool) -> int | None:
  """A trainer bound: its flag, else its variable (as a job reads it), else None (the default).
  With --check the bench's own bounds rule: a variable set then is said, not read."""
  setting = config_lib.SETTINGS_BY_FIELD[field]
  if flag is not None:
    value = p.setting(field, flag)
    return _fixed(setting, value)
  text = os.environ.get(setting.env, "")
  if not text:  # empty: unset, as everywhere (config.resolve); any other value is judged whole
    return None
  if check:
    print(f"tunix-stage simulate: note: {config_lib.assignment(setting.env, text)} is not read "
          "with --check (each mode runs with the bounds the bench ran with)", file=sys.stderr)
    return None
  try:
    return _fixed(setting, config_lib.parse_value(setting, text, setting.env))
  except config_lib.ConfigError as e:
    for line in e.problems:
      p.add(line)
    return None


def _fixed(setting: config_lib.Setting, value: Any) -> int | None:
  """A bound the simulator replays: a host bound at auto (sized by the trainer each step) is
  replayed at its start, said once."""
  if not config_lib.is_auto(value):
    return value
  print(f"tunix-stage simulate: note: {setting.env}=auto is replayed at {setting.fixed} (the "
        "simulator does not size the trainer's host bound)", file=sys.stderr)
  return None


def _check_inputs(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
  """Every flag at once, before the input is read: (values, []) or ({}, one line per problem)."""
  p = inputs.Problems()
  values: dict[str, Any] = {
      "modes": p.take("--modes", args.modes, _modes) or modes_lib.DEFAULT_MODES,
      "device": _bound(p, "max_device_batches", args.max_device_batches, args.check),
      "host": _bound(p, "max_host_batches", args.max_host_batches, args.check),
      "step": 1,
      "factors": {},
  }
  given_with = {}  # resource -> the --what_if that scaled it first
  for text in args.what_if:
    scaled = p.take("--what_if", text, _what_if)
    if scaled is None:
      continue
    resource, factor = scaled
    if resource in given_with:
      p.refuse("--what_if", text, "one --what_if per resource",
               f"{resource} is scaled already (--what_if {given_with[resource]})")
    elif args.check:
      p.refuse("--what_if", text, "--what_if without --check", "--check compares each "
               "prediction with the bench's measured run, which nothing scaled")
    given_with[resource] = text
    values["factors"][resource] = factor
  if args.check:
    for field in ("max_device_batches", "max_host_batches"):
      if getattr(args, field) is not None:
        flag = f"--{config_lib.SETTINGS_BY_FIELD[field].flag}"
        p.refuse(flag, getattr(args, field), f"{flag} without --check",
                 "--check runs each mode with the bounds the bench ran with (its options)")
  if args.step is not None and args.png is None:
    p.refuse("--step", args.step, "--step with --png", "it picks the step --png draws, and no "
             "--png is given")
  elif args.step is not None:
    values["step"] = p.take("--step", args.step, inputs.count)
  if args.json not in (None, "-"):
    p.take("--json", args.json, inputs.output_file)
  if args.png is not None:
    p.take("--png", args.png, inputs.output_png)
  values["device"] = values["device"] or config_lib.SETTINGS_BY_FIELD["max_device_batches"].default
  values["host"] = values["host"] or config_lib.SETTINGS_BY_FIELD["max_host_batches"].fixed
  return ({}, p.lines) if p else (values, [])


def run(args: argparse.Namespace) -> int:
  missing = lab.missing_line("simulate")
  if missing is not None:
    print(missing, file=sys.stderr)
    return 2
  values, problems = _check_inputs(args)  # the flags first, then the input they apply to
  if not problems:
    try:
      bench, traces, device, host = _load(args, values)
    except trace_lib.TraceError as e:  # one line each (a bench's two bounds may be two)
      problems = str(e).splitlines()
  if problems:
    for line in problems:
      print(f"tunix-stage simulate: error: {line}", file=sys.stderr)
    return 2
  modes, factors, step = values["modes"], values["factors"], values["step"]
  if bench is not None:
    report = _check(args.input, bench, traces, device, host)
  else:
    report = _predict(traces[modes[0]], modes, device, host)
  report["what_if"] = factors
  results = report.pop("_results")
  for path in (args.json, args.png):
    if path not in (None, "-"):
      os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  if args.json == "-":
    print(json.dumps(report, indent=1))
  else:
    print(_table(report))
    if args.json:
      with open(args.json, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
  if args.png:
    _picture(args.png, results, step, factors)
  failed = [m for m, r in report["modes"].items() if r.get("within_tolerance") is False]
  return 1 if failed else 0


def _load(args: argparse.Namespace, values: dict[str, Any]
          ) -> tuple[dict[str, Any] | None, dict[str, Any], int, int]:
  """(the bench JSON with --check, else None; the trace per mode; the device and host bounds),
  every check of the input done; TraceError otherwise."""
  modes = values["modes"]
  if args.check:
    bench, traces = _bench_traces(args.input, modes)  # per mode: (its trace, what it counted)
    device, host = _bench_bounds(args.input, bench)
  else:
    trace = _scaled(trace_lib.load(args.input, mode="resident"), args.what_if, values["factors"])
    bench, traces = None, {m: trace for m in modes}
    device, host = values["device"], values["host"]
  if args.png is not None:  # before any simulation: bad input is refused up front
    _check_step(values["step"], {m: t[0] if args.check else t for m, t in traces.items()})
  return bench, traces, device, host


def _scaled(trace: Any, texts: list[str], factors: dict[str, float]) -> Any:
  """The trace with --what_if's factors, still within the simulator's clock."""
  scaled = trace.scaled(factors)
  total = scaled.total_s()
  if factors and total > trace_lib.MAX_TOTAL_S:
    raise trace_lib.TraceError(core_inputs.invalid(
        "--what_if", " ".join(texts), f"factors that keep the trace's times within "
        f"{trace_lib.MAX_TOTAL_S:g} s in all", f"the scaled times add up to {total:.3g} s"))
  return scaled


def what_if_label(factors: dict[str, float]) -> str:
  """How the outputs say what shaped them: 'what if wire x0.5, h2d x2' ('' for none)."""
  return ("what if " + ", ".join(f"{r} x{f:g}" for r, f in factors.items())) if factors else ""


def _figures(result: Any, hidden: float | None, inline_total: float | None) -> dict[str, Any]:
  figures = {"predicted_median_step_s": result.median_step_s, "step_s": result.step_s,
             "predicted_mean_step_s": result.mean_step_s,
             "mid_step_idle_s": result.mid_step_idle_s, "boundary_idle_s": result.boundary_idle_s,
             "hidden_fraction": hidden, "total_s": result.total_s,
             "saved_s": None if inline_total is None else inline_total - result.total_s,
             "fallbacks": result.fallbacks, "peak_staged": result.peak_staged,
             "depths": result.depths}
  if result.choices:  # auto: each step's depth and why
    figures["choices"] = result.choices
  return figures


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
  last = min(len(t.steps) for t in traces.values()) - 1  # >= 1: a trace has 2 steps or more
  if step > last:
    raise trace_lib.TraceError(core_inputs.invalid(
        "--step", str(step), f"a step from 1 to {last} (the trace's steps after the fill, step 0)"))


def _bench_traces(path: str, modes: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
  """--check's input: the bench JSON and, per mode it measured, that mode's recorded times over
  the steps its medians counted, and which those are (trace.bench_trace)."""
  bench = trace_lib.read_json(path)
  if not isinstance(bench, dict) or not isinstance(bench.get("modes"), dict):
    raise trace_lib.TraceError(core_inputs.invalid(
        path, None, "with --check: a bench JSON (bench-out/bench.json)",
        "not a tunix-stage bench JSON (no modes)"))
  modes = tuple(m for m in modes if m in bench["modes"])
  if not modes:
    raise trace_lib.TraceError(core_inputs.invalid(
        path, None, "a bench JSON that measured one of the modes asked for",
        "no mode of this bench to check against"))
  for mode in modes:
    want = bench["modes"][mode].get("median_step_s") if isinstance(bench["modes"][mode], dict) \
        else None
    if isinstance(want, bool) or not isinstance(want, (int, float)) or not 0 < want < math.inf:
      raise trace_lib.TraceError(core_inputs.invalid(
          f"{path} modes.{mode}.median_step_s", json.dumps(want), "a number of seconds > 0"))
  return bench, {mode: trace_lib.bench_trace(bench, mode, path) for mode in modes}


def _bench_bounds(path: str, bench: dict[str, Any]) -> tuple[int, int]:
  """The device and host bounds the bench ran with (its options), by the settings' rules."""
  options = bench.get("options")
  options = options if isinstance(options, dict) else {}
  bounds = []
  for field in ("max_device_batches", "max_host_batches"):
    setting = config_lib.SETTINGS_BY_FIELD[field]
    value = options.get(field, config_lib.fixed(field, setting.default))
    try:
      bounds.append(config_lib.parse_value(setting, value if isinstance(value, str)
                                           else json.dumps(value), f"{path} options.{field}"))
    except config_lib.ConfigError as e:
      raise trace_lib.TraceError("\n".join(e.problems)) from None
  return bounds[0], bounds[1]


def _check(path: str, bench: dict[str, Any], traces: dict[str, Any], device: int,
           host: int) -> dict[str, Any]:
  from tunix_stage_plugin.lab.sim import run as run_lib  # pylint: disable=import-outside-toplevel
  measured = bench["modes"]
  options = bench.get("options")
  tiny = isinstance(options, dict) and options.get("tiny") is True  # milliseconds: judge nothing
  results = {mode: run_lib.simulate(trace, mode, max_device_batches=device,
                                    max_host_batches=host) for mode, (trace, _) in traces.items()}
  hidden = run_lib.hidden_fractions(results)
  report_modes = {}
  for mode, result in results.items():
    figures = _figures(result, hidden[mode], None)
    want = measured[mode]["median_step_s"]
    error = result.median_step_s / want - 1.0
    figures.update(measured_median_step_s=want, error=error,
                   within_tolerance=None if tiny else abs(error) <= CHECK_TOLERANCE,
                   counted=traces[mode][1].as_dict())
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
            ("mode", "step s", "mean s", "mid-step idle s", "boundary idle s", "hidden",
             "peak staged", "total s", "saved s"))
  rows = []
  for mode, r in report["modes"].items():
    if check:
      rows.append((mode, _fmt(r["predicted_median_step_s"], ".3f"),
                   _fmt(r["measured_median_step_s"], ".3f"), f"{r['error']:+.1%}",
                   _verdict(report, r)))
    else:
      mid = sorted(r["mid_step_idle_s"])[len(r["mid_step_idle_s"]) // 2]
      boundary = sorted(r["boundary_idle_s"])[len(r["boundary_idle_s"]) // 2]
      rows.append((mode, _fmt(r["predicted_median_step_s"], ".2f"),
                   _fmt(r["predicted_mean_step_s"], ".2f"), _fmt(mid, ".2f"),
                   _fmt(boundary, ".2f"), _fmt(r["hidden_fraction"], ".2f"),
                   str(r["peak_staged"]), _fmt(r["total_s"], ".1f"), _fmt(r["saved_s"], ".1f")))
  widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
  lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                     enumerate(zip(row, widths))).rstrip() for row in (header, *rows)]
  lines.insert(1, "  ".join("-" * w for w in widths).rstrip())
  title = (f"tunix-stage simulate --check {report['input']}: predicted vs measured median step, "
           "each over the steps the bench's median counted"
           + ("; a --tiny bench: its model computes in milliseconds, so its timings judge "
              "nothing (n/a)" if report.get("tiny") else "")
           if check else
           f"tunix-stage simulate {report['input']}: {report['steps']} steps, "
           f"{report['microbatches']} micro-batches; device bound {report['max_device_batches']}, "
           f"host bound {report['max_host_batches']}; "
           + (f"{what_if_label(report['what_if'])}; " if report["what_if"] else "")
           + "medians over steps 1.. (step 0 fills the pipeline); saved = inline total - mode "
           "total")
  if check:
    lines += _counted_lines(report)
  return "\n".join([title, "", *lines])


def _counted_lines(report: dict[str, Any]) -> list[str]:
  """Where a mode's medians left a run out or counted noisy steps: which runs and steps."""
  out = []
  for mode, r in report["modes"].items():
    c = r["counted"]
    if c["left_out"] or c["over"] != trace_lib.QUIET:
      left = ("; left out: " + ", ".join(f"runs[{i}]" for i in c["left_out"])
              + " (no quiet step: re-run)") if c["left_out"] else ""
      out.append(f"{mode}: {c['over']} of " + ", ".join(f"runs[{i}]" for i in c["runs"])
                 + f", timed steps {', '.join(str(s) for s in c['steps'])}{left}")
  return [""] + out if out else []


class _Picture:
  """What bench.plot draws for a run: one step's window of a simulated mode."""

  def __init__(self, mode: str, result: Any, step: int) -> None:
    from tunix_stage_plugin.core import tracks  # pylint: disable=import-outside-toplevel
    ends = {dict(s.args)["step"]: s.end for s in result.spans
            if s.track == tracks.DEVICE_COMPUTE and dict(s.args).get("kind") == tracks.UPDATE}
    self.mode, self.round = mode, 0
    self.origin = ends.get(step - 1, 0.0)
    end = ends[step]
    self.spans = [s for s in result.spans if s.end > self.origin and s.start < end]
    self.timings = [t for t in result.timings if t.step == step]


def _picture(path: str, results: dict[str, Any], step: int, factors: dict[str, float]) -> None:
  from tunix_stage_plugin.lab.bench import plot  # pylint: disable=import-outside-toplevel
  assert step <= min(len(r.step_s) for r in results.values()), step  # run() checked it
  label = what_if_label(factors)
  try:
    plot.write_timeline_png(path, [_Picture(m, r, step) for m, r in results.items()],
                            title=f"tunix-stage simulate: step {step}, predicted"
                            + (f"; {label}" if label else ""))
  except plot.PlotUnavailable as e:
    print(f"tunix-stage simulate: warning: {e}", file=sys.stderr)
