"""Recorded per-micro-batch times: the simulator's input, its formats and its what-if scaling."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import statistics
from typing import Any

from tunix_stage_plugin.core import timeline as timeline_lib

RESOURCES = ("wire", "h2d", "compute")
ACCEPTED_INPUT = "a trace JSON, a trace CSV (.csv) or a tunix-stage bench JSON, as UTF-8 text"


class TraceError(ValueError):
  """The input is not a trace the simulator reads; the message names what is wrong."""


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


def _number(value: Any, where: str) -> float:
  try:
    number = float(value)
  except (TypeError, ValueError):
    number = float("nan")
  if not math.isfinite(number) or number < 0:
    raise TraceError(f"{where}: {value!r} is not a time; accepted: a finite number of seconds >= 0")
  return number


def _check(trace: Trace) -> Trace:
  if not trace.steps:
    raise TraceError(f"{trace.source}: no step; accepted: at least one step of micro-batches")
  for i, step in enumerate(trace.steps):
    if not step.microbatches:
      raise TraceError(f"{trace.source}: step {i} has no micro-batch")
  return trace


def from_json(data: dict[str, Any], source: str) -> Trace:
  """{"steps": [{"update_s": .., "boundary_s": .., "microbatches": [{"wire_s", "h2d_s",
  "compute_s"}, ...]}, ...]} (examples/upstream_pattern.json)."""
  if not isinstance(data, dict) or not isinstance(data.get("steps"), list):
    raise TraceError(f"{source}: expected a JSON object with a 'steps' list (see examples/)")
  steps = []
  for i, step in enumerate(data["steps"]):
    if not isinstance(step, dict) or not isinstance(step.get("microbatches"), list):
      raise TraceError(f"{source}: step {i} needs a 'microbatches' list")
    mbs = tuple(MicroBatchTimes(*(_number(mb.get(f"{r}_s") if isinstance(mb, dict) else None,
                                          f"{source}: step {i} micro-batch {j} {r}_s")
                                  for r in RESOURCES))
                for j, mb in enumerate(step["microbatches"]))
    steps.append(StepTimes(mbs, _number(step.get("update_s", 0.0), f"{source}: step {i} update_s"),
                           _number(step.get("boundary_s", 0.0), f"{source}: step {i} boundary_s")))
  return _check(Trace(tuple(steps), source))


def from_csv(text: str, source: str) -> Trace:
  """Columns step, microbatch, wire_s, h2d_s, compute_s, and optionally update_s, boundary_s
  (a step's value on any of its rows)."""
  rows = list(csv.DictReader(text.splitlines()))
  need = {"step", "microbatch", "wire_s", "h2d_s", "compute_s"}
  if not rows or not need <= set(rows[0]):
    raise TraceError(f"{source}: expected CSV columns {sorted(need)} (plus optional update_s, "
                     "boundary_s)")
  by_step: dict[int, list[tuple[int, MicroBatchTimes]]] = {}
  extra: dict[int, tuple[float, float]] = {}
  for n, row in enumerate(rows, start=2):
    where = f"{source} line {n}"
    try:
      step, index = int(row["step"]), int(row["microbatch"])
    except ValueError:
      raise TraceError(f"{where}: step and microbatch must be integers") from None
    times = MicroBatchTimes(*(_number(row[f"{r}_s"], f"{where} {r}_s") for r in RESOURCES))
    by_step.setdefault(step, []).append((index, times))
    old = extra.get(step, (0.0, 0.0))
    extra[step] = (max(old[0], _number(row.get("update_s") or 0, f"{where} update_s")),
                   max(old[1], _number(row.get("boundary_s") or 0, f"{where} boundary_s")))
  steps = tuple(StepTimes(tuple(t for _, t in sorted(by_step[s])), *extra[s])
                for s in sorted(by_step))
  return _check(Trace(steps, source))


def from_bench(data: dict[str, Any], mode: str, source: str) -> Trace:
  """A `tunix-stage bench` JSON: the emulated wire and host-to-device times of every micro-batch
  (calibration), `mode`'s recorded fwd_bwd and update times (each position's median over the
  mode's runs, as the bench's own medians span its rounds), and the weight sync as the boundary."""
  calibration, runs = data.get("calibration"), data.get("runs")
  if not isinstance(calibration, dict) or not isinstance(runs, list):
    raise TraceError(f"{source}: not a finished tunix-stage bench report (no calibration/runs)")
  runs = [r for r in runs if r.get("mode") == mode and "fwd_bwd_s" in r]
  if not runs:
    raise TraceError(f"{source}: no {mode} run with recorded fwd_bwd times (a bench JSON from "
                     "this version of tunix-stage bench has them)")
  wire, h2d, sync = (_number(calibration[k], f"{source} calibration.{k}")
                     for k in ("wire_s", "h2d_s", "sync_s"))
  steps = []
  for i, step_compute in enumerate(runs[0]["fwd_bwd_s"]):
    compute = [statistics.median(_number(r["fwd_bwd_s"][i][j], f"{source} fwd_bwd_s")
                                 for r in runs) for j in range(len(step_compute))]
    update = statistics.median(_number(r["update_s"][i], f"{source} update_s") for r in runs)
    steps.append(StepTimes(tuple(MicroBatchTimes(wire, h2d, c) for c in compute), update, sync))
  return _check(Trace(tuple(steps), f"{source} ({mode})"))


def from_chrome_trace(data: dict[str, Any], source: str) -> Trace:
  """A `tunix-stage bench` trace.json: its first inline run, where every micro-batch's recorded
  spans are its own (the payload received, its host-to-device copy, its fwd_bwd), plus each
  step's update and weight sync. (tunix's `stage/*` step logs carry counts, not times: a job's
  times come from its profiler, written as a trace JSON or CSV.)"""
  events = data.get("traceEvents") if isinstance(data, dict) else None
  if not isinstance(events, list):
    raise TraceError(f"{source}: not a Chrome trace (no traceEvents)")
  processes = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
  pid = next((p for p, name in sorted(processes.items()) if name.startswith("inline ")), None)
  if pid is None:
    raise TraceError(f"{source}: no inline run in this trace; accepted: a tunix-stage bench "
                     "trace.json with the inline mode")
  tracks = {e["tid"]: timeline_lib.lane_track(e["args"]["name"]) for e in events
            if e.get("name") == "thread_name" and e["pid"] == pid}
  spans = [(tracks[e["tid"]], e) for e in events if e.get("ph") == "X" and e["pid"] == pid]
  seconds = lambda e: e["dur"] / 1e6
  receive = [seconds(e) for track, e in spans if track == "trainer/receive"]
  h2d = {e["name"]: seconds(e) for track, e in spans if track == "trainer/h2d"}
  steps: dict[int, dict[str, Any]] = {}
  for track, e in spans:
    if track == "device/compute":
      step = steps.setdefault(e["args"]["step"], {"compute": [], "update": 0.0, "sync": 0.0})
      if e["args"].get("kind") == "update":
        step["update"] = seconds(e)
      else:
        step["compute"].append((e["name"], seconds(e)))
    elif track == "device/sync":
      steps.setdefault(e["args"]["step"], {"compute": [], "update": 0.0, "sync": 0.0})["sync"] = \
          seconds(e)
  count = sum(len(s["compute"]) for s in steps.values())
  if not receive:  # payloads under 1 MiB travel as one message: no receive span, no wire time
    receive = [0.0] * count
  if len(receive) != count:
    raise TraceError(f"{source}: the inline run's payloads and fwd_bwd spans do not pair up")
  wire = iter(receive)  # in training order: the inline run sends one payload per train call
  return _check(Trace(tuple(StepTimes(tuple(
      MicroBatchTimes(next(wire), h2d.get(name, 0.0), compute) for name, compute in s["compute"]),
      s["update"], s["sync"]) for _, s in sorted(steps.items())), f"{source} (inline run)"))


def read_text(path: str) -> str:
  """The file's text; TraceError naming the file when it cannot be read or is not UTF-8 (a
  leading byte-order mark, as spreadsheets write, is dropped)."""
  try:
    with open(path, "rb") as f:
      raw = f.read()
  except OSError as e:
    raise TraceError(f"{path}: cannot read it ({e.strerror}); accepted: {ACCEPTED_INPUT}") from None
  try:
    return raw.decode("utf-8-sig")
  except UnicodeDecodeError as e:
    raise TraceError(f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                     f"accepted: {ACCEPTED_INPUT}") from None


def read_json(path: str) -> Any:
  """The file's JSON; TraceError naming the file otherwise."""
  text = read_text(path)
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    raise TraceError(f"{path}: not JSON ({e.msg} at line {e.lineno}); accepted: "
                     f"{ACCEPTED_INPUT}") from None


def load(path: str, mode: str | None = None) -> Trace:
  """A trace from a JSON or CSV file, or a bench JSON (with `mode`, its recorded times)."""
  if os.path.splitext(path)[1].lower() == ".csv":
    return from_csv(read_text(path), path)
  data = read_json(path)
  if isinstance(data, dict) and "calibration" in data and "runs" in data:
    return from_bench(data, mode or "inline", path)
  if isinstance(data, dict) and "traceEvents" in data:
    return from_chrome_trace(data, path)
  return from_json(data, path)
