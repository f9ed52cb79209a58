"""Recorded per-micro-batch times: the simulator's input, its formats and its what-if scaling.

Every input is checked whole before anything is simulated, and a problem is one line in the
settings' error shape (core.inputs.invalid) naming the file, the place in it and what is
accepted: a key or a column nothing reads, a duplicate or conflicting row and a time that is not
one are refused rather than ignored. The input is bounded (MAX_INPUT_BYTES, MAX_MICROBATCHES,
MAX_TOTAL_S) so that a simulation's time grows with its micro-batches and never with the values
in it (docs/simulate.md "Inputs and bounds").
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import statistics
import sys
from typing import Any

from tunix_stage_plugin.core import inputs
from tunix_stage_plugin.lab.bench import trace as trace_lib
from tunix_stage_plugin.core.telemetry import record as record_lib
from tunix_stage_plugin.reading import records as records_lib
from tunix_stage_plugin.reading import runs as runs_lib
from tunix_stage_plugin.lab import inputs as lab_inputs

RESOURCES = ("wire", "h2d", "compute")
ACCEPTED_INPUT = ("a trace JSON, a trace CSV (.csv), a tunix-stage bench JSON, a bench "
                  "trace.json, or a job's metrics record (.jsonl, or the folder "
                  "TUNIX_STAGE_METRICS named), as UTF-8 text (docs/simulate.md)")
MAX_INPUT_BYTES = 64 << 20  # a trace of MAX_MICROBATCHES rows is a few MiB
MAX_MICROBATCHES = 100_000  # about 2 minutes of simulation per mode on a 2-core machine
# The virtual clock (looptime 0.9) never fires a timer set past 2**24 s (194 days) of virtual
# time: the loop spins instead. A trace's times, added up, bound its simulated time (plus at most
# a 30 s refused-stage wait per micro-batch, model.SimTrainer.slot_wait_s), so they stay below it.
MAX_TOTAL_S = 1e7  # 116 days of recorded time in one trace, after --what_if
TIME_ACCEPTED = f"a finite number of seconds >= 0 and <= {MAX_TOTAL_S:g}"
JSON_KEYS = ("steps", "description")
STEP_KEYS = ("microbatches", "update_s", "boundary_s")
MICROBATCH_KEYS = tuple(f"{r}_s" for r in RESOURCES)
CSV_COLUMNS = ("step", "microbatch", *MICROBATCH_KEYS)
CSV_OPTIONAL = ("update_s", "boundary_s")


class TraceError(ValueError):
  """The input is not a trace the simulator reads; the message is the one error line."""


_NO_VALUE = object()  # (a JSON value may be null)


def _refuse(name: str, accepted: str, why: str | None = None, *,
            value: Any = _NO_VALUE) -> TraceError:
  """The one error line about `name` (and its `value`, when the problem is a value)."""
  return TraceError(inputs.invalid(name, None if value is _NO_VALUE else _text(value), accepted,
                                   why))


def _text(value: Any) -> str:
  return value if isinstance(value, str) else json.dumps(value)


@dataclasses.dataclass(frozen=True)
class MicroBatchTimes:
  wire_s: float  # its payload over the orchestrator-trainer link
  h2d_s: float  # its host-to-device copy
  compute_s: float  # its fwd_bwd on the device


@dataclasses.dataclass(frozen=True)
class StepTimes:
  microbatches: tuple[MicroBatchTimes, ...]
  update_s: float = 0.0  # the optimizer update on the device
  boundary_s: float = 0.0  # what else holds the trainer after the update (weight sync, checkpoint)


@dataclasses.dataclass(frozen=True)
class Trace:
  steps: tuple[StepTimes, ...]
  source: str = ""

  def scaled(self, factors: dict[str, float]) -> "Trace":
    """`--what_if wire=0.5x`: every wire (h2d, compute) time times its factor."""
    f = {r: factors.get(r, 1.0) for r in RESOURCES}
    return dataclasses.replace(self, steps=tuple(dataclasses.replace(step, microbatches=tuple(
        MicroBatchTimes(mb.wire_s * f["wire"], mb.h2d_s * f["h2d"], mb.compute_s * f["compute"])
        for mb in step.microbatches)) for step in self.steps))

  def total_s(self) -> float:
    """Every recorded time added up: what one inline pass over the trace at least takes."""
    return math.fsum(mb.wire_s + mb.h2d_s + mb.compute_s for step in self.steps
                     for mb in step.microbatches) + math.fsum(s.update_s + s.boundary_s
                                                              for s in self.steps)


def _number(value: Any, name: str) -> float:
  """A time: a JSON number or decimal text, finite, >= 0 and <= MAX_TOTAL_S."""
  if isinstance(value, str):
    try:
      return lab_inputs.number(value, at_least=0.0, at_most=MAX_TOTAL_S)
    except inputs.Refused:
      raise _refuse(name, TIME_ACCEPTED, value=value) from None
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    try:
      number = float(value)
    except OverflowError:  # an integer past float's range
      number = math.inf
    if math.isfinite(number) and 0.0 <= number <= MAX_TOTAL_S:
      return number
  raise _refuse(name, TIME_ACCEPTED, value=value)


def _time(times: dict[str, Any], key: str, name: str) -> float:
  if key not in times:
    raise _refuse(name, TIME_ACCEPTED, "missing")
  return _number(times[key], name)


def _field(container: Any, key: str | int, kind: type | tuple[type, ...], name: str) -> Any:
  """container[key], which must be a `kind`; TraceError naming `name` otherwise."""
  try:
    value = container[key]
  except (KeyError, IndexError, TypeError):
    raise _refuse(name, f"a {_kind_name(kind)} there", "missing") from None
  if not isinstance(value, kind) or isinstance(value, bool) and bool not in _kinds(kind):
    raise _refuse(name, f"a {_kind_name(kind)}", value=value)
  return value


def _kinds(kind: type | tuple[type, ...]) -> tuple[type, ...]:
  return kind if isinstance(kind, tuple) else (kind,)


def _kind_name(kind: type | tuple[type, ...]) -> str:
  names = {dict: "JSON object", list: "JSON list", str: "text", int: "number", float: "number"}
  return " or ".join(dict.fromkeys(names.get(k, k.__name__) for k in _kinds(kind)))


def _keys(data: dict[str, Any], accepted: tuple[str, ...], name: str) -> None:
  """Refuses a key nothing reads (a typo there would be silently ignored)."""
  for key in data:
    if key not in accepted:
      raise _refuse(f"{name} key {key!r}", ", ".join(accepted), "a key nothing reads")


def check_bounds(trace: Trace, name: str) -> Trace:
  """At least 2 steps, no empty step, at most MAX_MICROBATCHES micro-batches and MAX_TOTAL_S
  of recorded time; TraceError naming `name` otherwise."""
  if len(trace.steps) < 2:
    raise _refuse(name, "at least 2 steps (the first fills the pipeline, as a long run's "
                  "steady state)", f"{len(trace.steps)} step(s)")
  for i, step in enumerate(trace.steps):
    if not step.microbatches:
      raise _refuse(f"{name} step {i}", "at least one micro-batch per step",
                    "no micro-batch")
  count = sum(len(step.microbatches) for step in trace.steps)
  if count > MAX_MICROBATCHES:
    raise _refuse(name, f"at most {MAX_MICROBATCHES} micro-batches",
                  f"{count} micro-batches")
  total = trace.total_s()
  if total > MAX_TOTAL_S:
    raise _refuse(name, f"times that add up to at most {MAX_TOTAL_S:g} s (the simulator's "
                  "virtual clock stops past 194 days)",
                  f"its times add up to {total:.3g} s")
  return trace


def from_json(data: Any, source: str) -> Trace:
  """{"steps": [{"update_s": .., "boundary_s": .., "microbatches": [{"wire_s", "h2d_s",
  "compute_s"}, ...]}, ...]} (examples/upstream_pattern.json), and an optional "description"."""
  if not isinstance(data, dict) or not isinstance(data.get("steps"), list):
    raise _refuse(source, 'a JSON object with a "steps" list (examples/upstream_pattern.'
                  'json), a trace CSV or a bench JSON', "no steps list")
  _keys(data, JSON_KEYS, source)
  steps = []
  for i, step in enumerate(data["steps"]):
    where = f"{source} step {i}"
    _field(data["steps"], i, dict, where)
    _keys(step, STEP_KEYS, where)
    mbs = []
    for j, mb in enumerate(_field(step, "microbatches", list, f"{where} microbatches")):
      _field(step["microbatches"], j, dict, f"{where} micro-batch {j}")
      _keys(mb, MICROBATCH_KEYS, f"{where} micro-batch {j}")
      mbs.append(MicroBatchTimes(*(_time(mb, key, f"{where} micro-batch {j} {key}")
                                   for key in MICROBATCH_KEYS)))
    steps.append(StepTimes(tuple(mbs), *(_number(step.get(key, 0.0), f"{where} {key}")
                                         for key in CSV_OPTIONAL)))
  return check_bounds(Trace(tuple(steps), source), source)


def from_csv(text: str, source: str) -> Trace:
  """Columns step, microbatch, wire_s, h2d_s, compute_s, and optionally update_s, boundary_s
  (a step's value on any of its rows: the others empty or the same). One row per micro-batch; a
  step's micro-batches are numbered 0, 1, ...; steps are taken in number order."""
  columns_accepted = f"the columns {','.join(CSV_COLUMNS)}[,{','.join(CSV_OPTIONAL)}]"
  try:
    rows = list(csv.reader(text.splitlines()))
  except csv.Error as e:
    raise _refuse(source, "CSV text", f"not CSV ({e})") from None
  if not rows or not rows[0]:
    raise _refuse(source, f"a header row with {columns_accepted}, then a row per "
                  "micro-batch", "no header row")
  header = [c.strip() for c in rows[0]]
  for column in header:
    if column not in (*CSV_COLUMNS, *CSV_OPTIONAL):
      raise _refuse(f"{source} column {column!r}", columns_accepted, "a column nothing reads")
  missing = [c for c in CSV_COLUMNS if c not in header]
  if missing or len(set(header)) < len(header):
    raise _refuse(f"{source} header", columns_accepted,
                  f"no {', '.join(missing)} column" if missing else "a column twice",
                  value=",".join(header))
  if len(rows) == 1:
    raise _refuse(source, "a row per micro-batch under the header", "a header and no row")
  by_step: dict[int, dict[int, MicroBatchTimes]] = {}
  line_of: dict[tuple[int, int], int] = {}
  extra: dict[tuple[int, str], tuple[float, int]] = {}
  for n, cells in enumerate(rows[1:], start=2):
    where = f"{source} line {n}"
    if len(cells) != len(header):
      raise _refuse(where, "one cell per column",
                    f"{len(cells)} cells under {len(header)} columns")
    row = dict(zip(header, cells))
    step, index = (_index(row[c], f"{where} {c}") for c in ("step", "microbatch"))
    if (step, index) in line_of:
      raise _refuse(where, "one row per micro-batch",
                    f"step {step} micro-batch {index} again (line {line_of[step, index]})")
    line_of[step, index] = n
    by_step.setdefault(step, {})[index] = MicroBatchTimes(
        *(_number(row[key], f"{where} {key}") for key in MICROBATCH_KEYS))
    for key in CSV_OPTIONAL:
      if row.get(key, "").strip():
        value = _number(row[key], f"{where} {key}")
        first = extra.setdefault((step, key), (value, n))
        if first[0] != value:
          raise _refuse(f"{where} {key}", "one value per step, on any of its rows (the others "
                        "empty or the same)", f"step {step} has {first[0]:g} on line {first[1]}",
                        value=row[key])
  steps = []
  for step in sorted(by_step):
    indexes = sorted(by_step[step])
    if indexes != list(range(len(indexes))):
      gap = next(i for i, index in enumerate(indexes) if index != i)
      raise _refuse(f"{source} step {step}", "micro-batches numbered 0, 1, ... in each step",
                    f"no micro-batch {gap}")
    steps.append(StepTimes(tuple(by_step[step][i] for i in indexes),
                           *(extra.get((step, key), (0.0, 0))[0] for key in CSV_OPTIONAL)))
  return check_bounds(Trace(tuple(steps), source), source)


def _index(text: str, name: str) -> int:
  try:
    return inputs.integer(text, minimum=0, maximum=MAX_MICROBATCHES)
  except inputs.Refused as e:
    raise TraceError(inputs.refusal(name, text, e)) from None


@dataclasses.dataclass(frozen=True)
class Counted:
  """The steps of one mode's bench runs that its medians counted, by the bench's rule
  (lab/bench/report.summarize): the quiet ones (other processes within cpu.QUIET_CORES) where any
  is, else every one. `runs`: the runs that counted a step (indexes into the JSON's `runs`);
  `left_out`: the mode's runs with none counted, each re-run on a busy machine; `steps`: the
  timed steps (positions in a run) some run counted; `over`: which steps, in words."""

  runs: tuple[int, ...]
  left_out: tuple[int, ...]
  steps: tuple[int, ...]
  over: str

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


QUIET, NOISY, UNMARKED = ("quiet steps", "every step (no quiet one)",
                          "every step (the bench JSON marks none quiet)")


def from_bench(data: dict[str, Any], mode: str, source: str) -> Trace:
  """bench_trace's trace."""
  return bench_trace(data, mode, source)[0]


def bench_trace(data: dict[str, Any], mode: str, source: str) -> tuple[Trace, Counted]:
  """A `tunix-stage bench` JSON: the emulated wire and host-to-device times of every micro-batch
  (calibration), `mode`'s recorded fwd_bwd and update times over the steps its medians counted
  (each position's median over the runs that counted it, as the bench's own medians span its
  rounds; a run re-run on a busy machine counts none), and the weight sync as the boundary. The
  bench's warm-up step is not recorded: its first counted step stands in for it, as the step that
  fills the pipeline. Also which runs and steps those are."""
  calibration = _field(data, "calibration", dict, f"{source} calibration")
  runs = _field(data, "runs", list, f"{source} runs")
  wire, h2d, sync = (_number(_field(calibration, k, (int, float), f"{source} calibration.{k}"),
                             f"{source} calibration.{k}") for k in ("wire_s", "h2d_s", "sync_s"))
  mine = []
  for i in range(len(runs)):
    run = _field(runs, i, dict, f"{source} runs[{i}]")
    if run.get("mode") == mode and "fwd_bwd_s" in run:
      mine.append((i, run))
  if not mine:
    raise _refuse(source, f"a bench JSON with a {mode} run (from this version of "
                  "tunix-stage bench)", f"no {mode} run with recorded fwd_bwd times")
  shape = None
  quiet: dict[int, list[bool] | None] = {}
  for i, run in mine:
    where = f"{source} runs[{i}]"
    steps = _field(run, "fwd_bwd_s", list, f"{where}.fwd_bwd_s")
    found = [len(_field(steps, s, list, f"{where}.fwd_bwd_s[{s}]")) for s in range(len(steps))]
    updates = _field(run, "update_s", list, f"{where}.update_s")
    if shape is None:
      shape = found
    if found != shape or len(updates) != len(found):
      raise _refuse(where, f"the shape of runs[{mine[0][0]}] (micro-batches per step "
                    f"{shape}) and one update_s per step", "its steps differ")
    quiet[i] = _quiet(run, len(found), where)
  marked = any(q is not None for q in quiet.values())
  any_quiet = any(any(q or ()) for q in quiet.values())
  counted = {i: [True] * len(shape or ()) if not any_quiet or q is None else q
             for i, q in quiet.items()}

  def median(name: str, get, counting: list[tuple[int, Any]]) -> float:
    return statistics.median(_number(get(run), name) for _, run in counting)

  steps, positions = [], []
  for s, count in enumerate(shape or ()):
    counting = [(i, run) for i, run in mine if counted[i][s]]
    if not counting:
      continue  # no run counted this step: neither do the medians
    positions.append(s)
    compute = [median(f"{source} fwd_bwd_s[{s}][{j}]",
                      lambda r, s=s, j=j: r["fwd_bwd_s"][s][j], counting) for j in range(count)]
    update = median(f"{source} update_s[{s}]", lambda r, s=s: r["update_s"][s], counting)
    steps.append(StepTimes(tuple(MicroBatchTimes(wire, h2d, c) for c in compute), update, sync))
  name = f"{source} ({mode})"
  chosen = Counted(runs=tuple(i for i, _ in mine if any(counted[i])),
                   left_out=tuple(i for i, _ in mine if not any(counted[i])),
                   steps=tuple(positions),
                   over=QUIET if any_quiet else NOISY if marked else UNMARKED)
  return check_bounds(Trace(tuple(steps[:1] + steps), name), name), chosen


def _quiet(run: dict[str, Any], steps: int, where: str) -> list[bool] | None:
  """A run's `step_quiet` (one true or false per timed step), or None where it has none (a
  bench JSON from before the bench marked them)."""
  if "step_quiet" not in run:
    return None
  quiet = _field(run, "step_quiet", list, f"{where}.step_quiet")
  if len(quiet) != steps or not all(isinstance(q, bool) for q in quiet):
    raise _refuse(f"{where}.step_quiet", f"one true or false per timed step ({steps})",
                  value=quiet)
  return quiet


def from_chrome_trace(data: dict[str, Any], source: str) -> Trace:
  """A `tunix-stage bench` trace.json: its first inline run, where every micro-batch's recorded
  spans are its own (the payload received, its host-to-device copy, its fwd_bwd), plus each
  step's update and weight sync. (tunix's `stage/*` step logs carry counts, not times: a job's
  times come from its profiler, written as a trace JSON or CSV.)"""
  events = _field(data, "traceEvents", list, f"{source} traceEvents")
  checked = [_field(events, i, dict, f"{source} traceEvents[{i}]") for i in range(len(events))]

  def args_name(i: int, e: dict[str, Any]) -> str:
    return _field(_field(e, "args", dict, f"{source} traceEvents[{i}].args"), "name", str,
                  f"{source} traceEvents[{i}].args.name")

  processes = {_field(e, "pid", int, f"{source} traceEvents[{i}].pid"): args_name(i, e)
               for i, e in enumerate(checked) if e.get("name") == "process_name"}
  pid = next((p for p, name in sorted(processes.items()) if name.startswith("inline ")), None)
  if pid is None:
    raise _refuse(source, "a tunix-stage bench trace.json with the inline mode",
                  "no inline run in this trace")
  tracks = {_field(e, "tid", int, f"{source} traceEvents[{i}].tid"):
            trace_lib.lane_track(args_name(i, e)) for i, e in enumerate(checked)
            if e.get("name") == "thread_name" and e.get("pid") == pid}
  spans = []
  for i, e in enumerate(checked):
    if e.get("ph") == "X" and e.get("pid") == pid:
      where = f"{source} traceEvents[{i}]"
      tid = _field(e, "tid", int, f"{where}.tid")
      if tid not in tracks:
        raise _refuse(f"{where}.tid", "a thread named by a thread_name event", value=tid)
      spans.append((tracks[tid], e, where))
  seconds = lambda e, where: _number(_field(e, "dur", (int, float), f"{where}.dur"),
                                     f"{where}.dur") / 1e6
  step_of = lambda e, where: _field(_field(e, "args", dict, f"{where}.args"), "step", int,
                                    f"{where}.args.step")
  receive = [seconds(e, w) for track, e, w in spans if track == "trainer/receive"]
  h2d = {_field(e, "name", str, f"{w}.name"): seconds(e, w)
         for track, e, w in spans if track == "trainer/h2d"}
  steps: dict[int, dict[str, Any]] = {}
  for track, e, where in spans:
    if track in ("device/compute", "device/sync"):
      step = steps.setdefault(step_of(e, where), {"compute": [], "update": 0.0, "sync": 0.0})
      if track == "device/sync":
        step["sync"] = seconds(e, where)
      elif e["args"].get("kind") == "update":
        step["update"] = seconds(e, where)
      else:
        step["compute"].append((_field(e, "name", str, f"{where}.name"), seconds(e, where)))
  count = sum(len(s["compute"]) for s in steps.values())
  if not receive:  # payloads under 1 MiB travel as one message: no receive span, no wire time
    receive = [0.0] * count
  if len(receive) != count:
    raise _refuse(source, "a bench trace.json as the bench wrote it",
                  f"the inline run's {len(receive)} payloads and {count} fwd_bwd spans do not "
                  "pair up")
  wire = iter(receive)  # in training order: the inline run sends one payload per train call
  name = f"{source} (inline run)"
  return check_bounds(Trace(tuple(StepTimes(tuple(
      MicroBatchTimes(next(wire), h2d.get(mb, 0.0), compute) for mb, compute in s["compute"]),
      s["update"], s["sync"]) for _, s in sorted(steps.items())), name), name)


def read_text(path: str) -> str:
  """The file's text; TraceError naming the file when it is not a regular file of at most
  MAX_INPUT_BYTES, cannot be read or is not UTF-8 (a leading byte-order mark, as spreadsheets
  write, is dropped)."""
  try:
    raw = lab_inputs.read_file(path, ACCEPTED_INPUT, MAX_INPUT_BYTES)
  except inputs.Refused as e:
    raise TraceError(inputs.refusal(path, None, e)) from None
  try:
    return raw.decode("utf-8-sig")
  except UnicodeDecodeError as e:
    raise _refuse(path, ACCEPTED_INPUT, f"not UTF-8 text (byte 0x{raw[e.start]:02x} at "
                  f"offset {e.start})") from None


def read_json(path: str) -> Any:
  """The file's JSON; TraceError naming the file otherwise."""
  text = read_text(path)
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    raise _refuse(path, ACCEPTED_INPUT, f"not JSON ({e.msg} at line {e.lineno})") from None
  except (ValueError, RecursionError) as e:  # a number of more than 4300 digits; deep nesting
    raise _refuse(path, ACCEPTED_INPUT, f"JSON that cannot be read ({type(e).__name__}: "
                  f"{str(e)[:60]})") from None


def from_records(path: str) -> Trace:
  """A job's metrics record (core.telemetry: a .jsonl file, or the folder TUNIX_STAGE_METRICS
  named) holding one run, as from_run reads it. Records of several runs are refused, naming each
  run's files: a trace is one job's."""
  try:
    found, notes = runs_lib.runs([path])
  except records_lib.RecordError as e:
    raise TraceError(str(e)) from None
  for note in notes:  # a file skipped or cut short: said, as report says it
    print(f"tunix-stage simulate: note: {note}", file=sys.stderr)
  if len(found) > 1:
    named = "; ".join(f"run {n} started {runs_lib.when(r.started)}: {', '.join(r.files)}"
                      for n, r in enumerate(found, start=1))
    raise _refuse(path, "one run's records: give one run's files (its trainer's .jsonl)",
                  f"it holds {len(found)} runs ({named})")
  return of_steps(found[0].trainer_steps, path)


def of_steps(trainer: Any, source: str) -> Trace:
  """One run's trainer steps already read (reading.runs: a Run's, a pandas DataFrame in its
  order), each as the trainer measured it. Per micro-batch: the step's median fwd_bwd as
  compute, its receives' mean time as wire (0 where none was timed: tunix's own unary call is
  received before any hook sees it), its placements' mean time as h2d; the step's update; its
  compute lane's own calls (a weight sync) as the boundary."""
  steps = []
  for r in trainer.itertuples(index=False):
    wire = r.received_s / r.received if r.received else 0.0
    h2d = r.placed_s / r.placed if r.placed else 0.0
    compute = r.fwd_bwd_median_s
    if not r.microbatches or compute != compute:  # no fwd_bwd (NaN): nothing to simulate
      continue
    steps.append(StepTimes(tuple(MicroBatchTimes(float(wire), float(h2d), float(compute))
                                 for _ in range(int(r.microbatches))),
                           float(r.update_s), float(r.other_s)))
  if not steps:
    raise _refuse(source, ACCEPTED_INPUT, "no trainer record with a fwd_bwd in it")
  return check_bounds(Trace(tuple(steps), source), source)


def load(path: str, mode: str | None = None) -> Trace:
  """A trace from a JSON or CSV file, a bench JSON (with `mode`, its recorded times), or a
  job's metrics record."""
  if os.path.isdir(path) or path.endswith(record_lib.SUFFIX):
    return from_records(path)
  if os.path.splitext(path)[1].lower() == ".csv":
    return from_csv(read_text(path), path)
  data = read_json(path)
  if isinstance(data, dict) and "calibration" in data and "runs" in data:
    return from_bench(data, mode or "inline", path)
  if isinstance(data, dict) and "traceEvents" in data:
    return from_chrome_trace(data, path)
  return from_json(data, path)
