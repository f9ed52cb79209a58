"""`tunix-stage bench`: the staging A/B on the embedded host, on any machine."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import textwrap
from typing import TYPE_CHECKING, Any

from tunix_stage_plugin import lab
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import inputs as core_inputs
from tunix_stage_plugin.lab.bench import modes as modes_lib
from tunix_stage_plugin.lab import inputs

if TYPE_CHECKING:  # the bench modules load jax; `tunix-stage --help` should not wait for that
  from tunix_stage_plugin.lab.bench import results

DEFAULT_OUT = "bench-out"
QUICK = {"rounds": 1, "steps": 2}
FULL = {"rounds": 3, "steps": 2}


def _modes(text: str) -> tuple[str, ...]:
  modes = tuple(m.strip() for m in text.split(",") if m.strip())
  bad = [m for m in modes if m not in modes_lib.MODES]
  if bad or not modes or len(set(modes)) != len(modes):
    raise inputs.Refused(f"a comma-separated subset of {','.join(modes_lib.MODES)}, each at most "
                         "once")
  return modes


def _check_codec_modes(p: inputs.Problems, text: str | None, modes: tuple[str, ...],
                       codec: str | None) -> None:
  """A codec mode with --stage_codec off compresses with `on`: its library must be installed."""
  # pylint: disable=import-outside-toplevel,redefined-outer-name
  from tunix_stage_plugin.lab.bench import results
  from tunix_stage_plugin.core import codec as codec_lib
  named = [m for m in modes if modes_lib.BY_NAME[m].codec]
  if named and codec == codec_lib.OFF:  # an invalid --stage_codec is reported on its own
    try:
      results.mode_codec(codec, named[0])
    except codec_lib.CodecUnavailable as e:
      p.refuse("--modes", text, "modes that do not compress, or the codec's library installed",
               f"{','.join(named)} compresses with {codec_lib.ON} (--stage_codec is off), and "
               f"{e}")


def add_parser(subparsers: argparse._SubParsersAction, help_line: str) -> None:
  """The subcommand's parser; `help_line` is what `tunix-stage --help` shows (cli.main's table)."""
  parser = subparsers.add_parser(
      "bench",
      help=help_line,
      description=textwrap.fill(
          "Run the staging A/B. On the embedded host (the default): a JAX trainer process "
          "serving gRPC on 127.0.0.1, an orchestrator driving it through the stage pipeline, and "
          "emulated links calibrated to production's proportions (wire 0.8 x and host-to-device "
          "0.4 x the compute of one micro-batch). With --host tunix: trainer node processes of "
          "tunix's own classes driven by tunix's own train loop, over tunix's real links (the "
          "payload size is the knob). The modes alternate in rounds; the table reports medians. "
          "Writes a JSON report, a PNG timeline and a Chrome/Perfetto trace.", 78) + "\n\n" +
      textwrap.fill(
          "Exit 0 when the run completed and every correctness check passed (a timing check "
          "fails the exit code only with --strict), 1 otherwise, 2 for bad options (every "
          "option is checked before anything starts). SIGINT (Ctrl-C) or SIGTERM stops the "
          "trainer, writes the JSON with the runs finished so far (\"interrupted\": true) and "
          "exits 130 or 143.", 78),
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=modes_lib.epilog(),
  )
  size = parser.add_argument_group("run length")
  size.add_argument("--quick", action="store_true",
                    help=f"short run (about a minute): {QUICK['rounds']} round of {QUICK['steps']} "
                    "timed steps per mode unless --rounds/--steps say otherwise")
  size.add_argument("--rounds", default=None, metavar="N",
                    help=f"rounds; each runs every mode once, rotating the order "
                    f"(default {FULL['rounds']}, --quick {QUICK['rounds']})")
  size.add_argument("--steps", default=None, metavar="N",
                    help=f"timed steps per mode run, after one warm-up step "
                    f"(default {FULL['steps']})")
  size.add_argument("--retries", default="3", metavar="N",
                    help="re-run a mode run in which other processes used more than 0.2 cores "
                    "during every timed step, at most N times in all (default 3; 0: never)")
  size.add_argument("--modes", default=None, metavar="LIST",
                    help="comma-separated modes to run (default: "
                    f"{','.join(modes_lib.DEFAULT_MODES)})")
  where = parser.add_argument_group("host")
  where.add_argument("--host", default="embedded", metavar="NAME",
                     help=f"which host runs the A/B: {' | '.join(modes_lib.HOST_NAMES)} (default "
                     "embedded; see below). On tunix the links are tunix's own: --wire_ratio, "
                     "--h2d_ratio, --sync_ratio, --h2d and --scenario apply to embedded only")
  shape = parser.add_argument_group("workload and emulated links")
  shape.add_argument("--microbatches", default="4", metavar="M",
                     help="micro-batches per step (default 4)")
  shape.add_argument("--payload_mib", default="16", metavar="MIB",
                     help="bytes of one micro-batch, in MiB (default 16; 1/1024 to "
                     f"{inputs.MAX_PAYLOAD_MIB:g}, and what the held micro-batches need must fit "
                     "in MemAvailable); sets only the real bytes copied, the emulated times "
                     "follow the ratios")
  shape.add_argument("--payload", default="dense", metavar="KIND",
                     help="what a micro-batch carries: dense (tokens + float32 ballast, the "
                     "default) or rl (ids, masks, advantages, log-probs, routed_experts int16; "
                     "docs/bench.md \"The rl payload\")")
  shape.add_argument("--stage_codec", default=None, metavar="CODEC",
                     help="compress staged payloads on the wire (TUNIX_STAGE_CODEC's values: off, "
                     "on, NAME[:LEVEL]; default $TUNIX_STAGE_CODEC, else off; needs the codec "
                     "extra, docs/codec.md); inline calls are never compressed")
  shape.add_argument("--wire_ratio", default=None, metavar="X",
                     help="wire time of one micro-batch as a multiple of its compute (default 0.8)")
  shape.add_argument("--h2d", default=None, metavar="HOW",
                     help="host-to-device copies: " + "; ".join(
                         f"{k}: {v}" for k, v in modes_lib.H2D.items()))
  shape.add_argument("--h2d_ratio", default=None, metavar="X",
                     help="emulated host-to-device time as a multiple of compute (default 0.4; "
                     "--h2d emulated only)")
  shape.add_argument("--sync_ratio", default=None, metavar="X",
                     help="the step boundary's weight sync as a multiple of compute (default 0.5)")
  shape.add_argument("--stage_max_device_batches", dest="max_device_batches", default=None,
                     metavar="N", help="the trainer's device bound for every mode (default "
                     "$TUNIX_STAGE_MAX_DEVICE_BATCHES, else 1, production's)")
  shape.add_argument("--stage_max_host_batches", dest="max_host_batches", default=None,
                     metavar="N", help="the trainer's bound on received-but-unplaced "
                     "micro-batches (default $TUNIX_STAGE_MAX_HOST_BATCHES, else 1)")
  shape.add_argument("--scenario", default=None, metavar="NAME",
                     help=f"how transfers behave: {' | '.join(modes_lib.SCENARIOS)} (default "
                     "steady; see below)")
  shape.add_argument("--seed", default="0", metavar="N",
                     help=f"parameters and data seed, 0 to {inputs.SEED_LIMIT - 1} (default 0)")
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
  out.add_argument("--quiet", action="store_true",
                   help="no progress lines and no per-step lines on stderr (the job's per-step "
                   "lines otherwise every $TUNIX_STAGE_LOG_EVERY steps, default 1; "
                   "TUNIX_STAGE_METRICS is refused: the trainer's own records are in the JSON)")
  out.add_argument("--compare", nargs=2, default=None, metavar=("A.json", "B.json"),
                   help="run no benchmark: print two bench JSONs side by side per mode (step, "
                   "hidden, step/limit, fallbacks and the change from A to B)")
  out.add_argument("--strict", action="store_true",
                   help="exit 1 when a timing check fails, too")
  parser.set_defaults(run=run)


_FILES = {"json": "bench.json", "png": "timeline.png", "trace": "trace.json"}


# The options only the embedded host's emulated links read: (flag, args attribute).
EMBEDDED_ONLY = (("--wire_ratio", "wire_ratio"), ("--h2d_ratio", "h2d_ratio"),
                 ("--sync_ratio", "sync_ratio"), ("--h2d", "h2d"), ("--scenario", "scenario"))
TUNIX_PROGRAM = "tunix.experimental.orchestrator.rl_program"


def _tunix_problem() -> str | None:
  """Why tunix's experimental stack cannot be imported here (None: it can)."""
  try:
    importlib.import_module(TUNIX_PROGRAM)
  except ImportError as e:
    return f"tunix's experimental stack is not importable here ({e})"
  return None


def _check_host(p: inputs.Problems, args: argparse.Namespace) -> str | None:
  host = p.take("--host", args.host, inputs.one_of(modes_lib.HOST_NAMES))
  if host == "tunix":
    given = [flag for flag, name in EMBEDDED_ONLY if getattr(args, name) is not None]
    if given:
      p.refuse("--host", host, "with --host tunix, none of them (tunix's links are its own)",
               f"{', '.join(given)} set the embedded host's emulated links")
    else:
      found = _tunix_problem()
      if found:
        p.refuse("--host", host, "embedded, or tunix where tunix's experimental stack is "
                 "installed with the plugin (docs/tunix.md \"Tests against real tunix\")", found)
  return host


def _check(args: argparse.Namespace) -> tuple[results.BenchOptions | None, dict[str, str],
                                               list[str]]:
  """Every option at once: (options, output files, []) or (None, {}, one line per problem)."""
  # pylint: disable=import-outside-toplevel,redefined-outer-name
  from tunix_stage_plugin.lab.bench import results
  from tunix_stage_plugin.lab.bench import runner
  from tunix_stage_plugin.lab.embedded import data as data_lib

  p = inputs.Problems()
  length = QUICK if args.quick else FULL
  defaults = results.BenchOptions()
  host = _check_host(p, args)
  values: dict[str, Any] = {
      "host": host,
      "rounds": p.take("--rounds", args.rounds, inputs.count) or length["rounds"],
      "steps": p.take("--steps", args.steps, inputs.count) or length["steps"],
      "retries": p.take("--retries", args.retries,
                        lambda t: inputs.integer(t, minimum=0, maximum=inputs.MAX_COUNT)),
      "modes": p.take("--modes", args.modes, _modes) or modes_lib.DEFAULT_MODES,
      "microbatches": p.take("--microbatches", args.microbatches, inputs.count),
      "payload_mib": p.take("--payload_mib", args.payload_mib, inputs.payload_mib),
      "wire_ratio": _given(p.take("--wire_ratio", args.wire_ratio, inputs.positive), defaults.wire_ratio),
      "h2d_ratio": _given(p.take("--h2d_ratio", args.h2d_ratio, inputs.positive), defaults.h2d_ratio),
      "h2d": _given(p.take("--h2d", args.h2d, inputs.one_of(modes_lib.H2D)), defaults.h2d),
      "sync_ratio": _given(p.take("--sync_ratio", args.sync_ratio, inputs.nonnegative), defaults.sync_ratio),
      **_settings(p, args),  # the bounds, the codec and the per-step lines
      "scenario": _given(p.take("--scenario", args.scenario, inputs.one_of(modes_lib.SCENARIOS)),
                         defaults.scenario),
      "seed": p.take("--seed", args.seed, inputs.seed),
      "payload": p.take("--payload", args.payload, inputs.one_of(data_lib.PAYLOADS)),
  }
  _check_codec_modes(p, args.modes, values["modes"] or (), values["codec"])
  files = {}
  out_ok = True
  if any(getattr(args, kind) is None for kind in _FILES):  # some file goes into --out
    out_ok = p.take("--out", args.out, inputs.output_dir) is not None
  for kind, name in _FILES.items():
    given = getattr(args, kind)
    if given == "":
      continue  # '' skips that file
    if given is None and not out_ok:
      continue  # already reported as --out
    path = given if given is not None else os.path.join(args.out, name)
    if p.take(f"--{kind}" if given is not None else f"--{kind} (default {path})", path,
              inputs.output_png if kind == "png" else inputs.output_file) is not None:
      files[kind] = path
  real = {os.path.realpath(path): kind for kind, path in files.items()}
  if len(real) < len(files):
    p.refuse("--json, --png and --trace", None, "a different path for each",
             "two of them name the same file")
  if p:
    return None, {}, p.lines
  options = results.BenchOptions(tiny=args.tiny, **values)
  held, what = runner.payloads_held(options)
  memory = inputs.memory_refusal(options.sizes().payload_bytes, held, what)
  if memory is not None:
    return None, {}, [core_inputs.refusal("--payload_mib", args.payload_mib, memory)]
  return options, files, []


# The staging settings the bench reads as everywhere (its flag beats the variable, which beats
# the default), and those each mode sets itself, whose variables it does not read.
READ = ("max_device_batches", "max_host_batches", "codec", "metrics", "log_every",
        "memory_budget")
SET_BY_MODE = ("mode", "max_staged_batches", "accept_train_stage")
NO_RECORD = ("the bench writes no metrics record (its mode runs would share one): its JSON "
             "holds the trainer's own per-step records, run by run (runs[*].job_side_steps)")


def _settings(p: inputs.Problems, args: argparse.Namespace) -> dict[str, Any]:
  """READ's values, each checked by the settings table, every bad one reported: the job's
  per-step lines every TUNIX_STAGE_LOG_EVERY steps (0 with --quiet); TUNIX_STAGE_METRICS refused
  (the bench's mode runs would share one record)."""
  by_field = config_lib.SETTINGS_BY_FIELD
  env = {by_field[f].env: os.environ.get(by_field[f].env, "") for f in READ}
  metrics = by_field["metrics"]
  try:
    folder = config_lib.parse_value(metrics, env[metrics.env], metrics.env)
  except config_lib.ConfigError:
    folder = ""  # unset, or invalid: resolve says so below
  if folder:
    p.refuse(metrics.env, env[metrics.env], "unset, or off", NO_RECORD)
  try:
    cfg = config_lib.resolve(
        {"max_device_batches": args.max_device_batches,
         "max_host_batches": args.max_host_batches, "codec": args.stage_codec},
        env=env, explicit_source="flag")
  except config_lib.ConfigError as e:
    for line in e.problems:
      p.add(line)
    return {**{f: None for f in READ if f != "metrics"}, "size_host_bound": False}
  return {"max_device_batches": cfg.max_device_batches,
          # At auto (the default) the fixed modes run at its fixed value and the auto mode sizes
          # it, as a job at the default settings does.
          "max_host_batches": config_lib.fixed("max_host_batches", cfg.max_host_batches),
          "size_host_bound": config_lib.is_auto(cfg.max_host_batches), "codec": cfg.codec,
          "log_every": 0 if args.quiet else cfg.log_every, "memory_budget": cfg.memory_budget}


def unread_note() -> str | None:
  """One line naming the staging variables set here that the bench does not read (its modes set
  staging, the depth and the loop), or None."""
  unread = [config_lib.assignment(s.env, os.environ[s.env]) for s in config_lib.SETTINGS
            if s.field in SET_BY_MODE and os.environ.get(s.env, "")]
  if not unread:
    return None
  return (f"tunix-stage bench: note: {', '.join(unread)} not read: each mode sets staging and its "
          "depth (--modes)")


def _given(value: Any, default: Any) -> Any:
  """An option's checked value, or its default when it was not given."""
  return default if value is None else value


class _Interrupts:
  """SIGINT and SIGTERM become one KeyboardInterrupt in the main thread.

  Later signals are only noted: the trainer must still be stopped and the JSON written. Once the
  runs are over (`raising` False) a signal is noted too, and the command exits 130/143 after its
  report.
  """

  EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}

  def __init__(self) -> None:
    self.signum: int | None = None
    self.raising = True  # False once the runs are over: the report is written, then we exit
    self._previous: dict[int, Any] = {}

  def _handle(self, signum: int, _frame: Any) -> None:
    if self.signum is not None:
      return
    self.signum = signum
    if self.raising:
      raise KeyboardInterrupt

  @property
  def name(self) -> str | None:
    return None if self.signum is None else signal.Signals(self.signum).name

  def __enter__(self) -> "_Interrupts":
    for sig in self.EXIT_CODES:
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc: object) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def _besides_compare(args: argparse.Namespace) -> list[str]:
  """The options given with --compare (which runs nothing, so each would change nothing)."""
  parser = args.subcommands["bench"]
  return [a.option_strings[0] for a in parser._actions  # pylint: disable=protected-access
          if a.option_strings and a.dest not in ("help", "compare")
          and getattr(args, a.dest) != a.default]


def run(args: argparse.Namespace) -> int:
  if args.compare:
    besides = _besides_compare(args)
    if besides:
      print("tunix-stage bench: error: " + core_inputs.invalid(
          "--compare", None, "--compare A.json B.json alone",
          f"it runs no benchmark, so {', '.join(besides)} would change nothing"), file=sys.stderr)
      return 2
    return _compare(*args.compare)
  missing = lab.missing_line("bench")
  if missing is not None:
    print(missing, file=sys.stderr)
    return 2
  os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
  with _Interrupts() as caught:
    try:
      return _run(args, caught)
    except KeyboardInterrupt:  # before the benchmark began: nothing to save
      print(f"tunix-stage bench: interrupted by {caught.name or 'SIGINT'}", file=sys.stderr)
      return _Interrupts.EXIT_CODES[caught.signum or signal.SIGINT]


def _run(args: argparse.Namespace, caught: _Interrupts) -> int:
  # pylint: disable=import-outside-toplevel  (keep `tunix-stage --help` fast)
  from tunix_stage_plugin.lab.bench import host as host_lib
  from tunix_stage_plugin.lab.bench import report
  from tunix_stage_plugin.lab.bench import results  # pylint: disable=redefined-outer-name
  from tunix_stage_plugin.lab.bench import runner
  from tunix_stage_plugin.lab.embedded import client
  from tunix_stage_plugin.lab.embedded import process

  options, files, problems = _check(args)
  if options is None:
    for line in problems:
      print(f"tunix-stage bench: error: {line}", file=sys.stderr)
    return 2
  note = unread_note()
  if note is not None:
    print(note, file=sys.stderr)
  _say_overwrite(args, files)
  for path in files.values():
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)

  def progress(line: str) -> None:
    if not args.quiet:
      print(line, file=sys.stderr, flush=True)

  result = results.BenchResult(options)
  try:
    runner.run_bench(options, progress, result=result)
  except KeyboardInterrupt:
    pass  # caught.signum says which signal; result holds the runs that finished
  except (process.TrainerProcessError, *client.CALL_ERRORS) as e:
    if caught.signum is None:  # else: Ctrl-C reached the trainer too, which then stopped
      print(f"tunix-stage bench: error: {client.describe_call_error(e, 'the trainer process')}",
            file=sys.stderr)
      return 1
  except host_lib.HostError as e:
    if caught.signum is None:
      print(f"tunix-stage bench: error: {e}", file=sys.stderr)
      return 1
  except Exception:  # pylint: disable=broad-except
    if caught.signum is None:
      raise  # a bug: its traceback is the report
    # else: the signal reached the trainer side too (a Ctrl-C reaches the process group), and a
    # call in flight failed with it; the interrupted report follows
  finally:
    caught.raising = False
  if caught.signum is not None:
    result.interrupted = caught.name
    written = _write(result, files, report.summarize(result))
    print(f"tunix-stage bench: interrupted by {caught.name}; wrote {', '.join(written)} "
          f"with the {len(result.runs)} mode run(s) that finished", file=sys.stderr)
    return _Interrupts.EXIT_CODES[caught.signum]
  summary = report.summarize(result)
  checks = report.criteria(result, summary)
  written = _write(result, files, summary, checks)
  print(report.format_report(result, summary, checks))
  print("wrote " + ", ".join(written) + f" ({result.wall_s:.0f} s)")
  if caught.signum is not None:  # arrived while the report was being written: it is complete
    print(f"tunix-stage bench: interrupted by {caught.name} after the last run", file=sys.stderr)
    return _Interrupts.EXIT_CODES[caught.signum]
  failed = [c for c in checks
            if c.passed is False and (c.kind == report.CORRECTNESS or args.strict)]
  if result.trainer_exit_code != 0:
    print(f"tunix-stage bench: error: the trainer exited with code {result.trainer_exit_code}",
          file=sys.stderr)
    return 1
  return 1 if failed else 0


def _compare(path_a: str, path_b: str) -> int:
  from tunix_stage_plugin.lab.bench import compare  # pylint: disable=import-outside-toplevel

  try:
    print(compare.compare(path_a, path_b))
  except compare.CompareError as e:
    print("tunix-stage bench: error: "
          + core_inputs.invalid("--compare", e.path, compare.ACCEPTED, e.why), file=sys.stderr)
    return 2
  return 0


def _say_overwrite(args: argparse.Namespace, files: dict[str, str]) -> None:
  """One line on stderr when the default folder already holds a run that this one replaces."""
  old = os.path.join(DEFAULT_OUT, _FILES["json"])
  if args.out != DEFAULT_OUT or files.get("json") != old or not os.path.isfile(old):
    return
  from tunix_stage_plugin.lab.bench import meta  # pylint: disable=import-outside-toplevel
  print(f"tunix-stage bench: overwriting {DEFAULT_OUT}/ from {meta.run_date(old)}; "
        "use --out DIR to keep it", file=sys.stderr)


def _write(result: results.BenchResult, files: dict[str, str],
           summary: dict[str, Any], checks: list[Any] | None = None) -> list[str]:
  """Writes the PNG and trace (when a run finished), then the JSON; returns the paths written."""
  # pylint: disable=import-outside-toplevel
  from tunix_stage_plugin.lab.bench import plot
  from tunix_stage_plugin.lab.bench import report
  from tunix_stage_plugin.lab.bench import results  # pylint: disable=redefined-outer-name
  from tunix_stage_plugin.lab.bench import trace

  files = dict(files)
  if not result.runs:
    files = {k: v for k, v in files.items() if k == "json"}
  if "png" in files:
    last_round = list(results.runs_of_round(result, result.runs[-1].round).values())
    try:
      plot.write_timeline_png(files["png"], last_round,
                              title="tunix-stage bench: device compute and staging per mode")
    except plot.PlotUnavailable as e:
      print(f"tunix-stage bench: warning: {e}", file=sys.stderr)
      del files["png"]
  if "trace" in files:
    trace.write_trace(files["trace"], result.runs)
  if "json" in files:
    checks = report.criteria(result, summary) if checks is None else checks
    with open(files["json"], "w", encoding="utf-8") as f:
      json.dump(report.to_json(result, summary, checks, files), f, indent=1)
  return list(files.values())
