"""A job's runs, told apart in its metrics records, so that a report never takes one median over
two jobs. A process's records of one run carry its run's id and start (record version 2; a
version-1 record's run is its process). An orchestrator's run is one job (the orchestrator
drives it); each trainer step's record joins the job whose orchestrator ran that step (tunix's
train step, on both sides) and whose steps it falls among in time, on hosts that meet (tunix's
orchestrator and the trainers behind tunix's worker; the embedded host's two): two jobs one
after the other are two, however close. A trainer step of no orchestrator's is a run of its
trainer alone. docs/observability.md
"tunix-stage report".
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import gc
import operator
import os
from array import array
from typing import Any, Iterable

from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core.telemetry import record as record_lib
from tunix_stage_plugin.core.telemetry import steps as steps_lib

# The hosts a trainer's record may name behind the orchestrator's: MaxText's engine runs behind
# tunix's worker, driven by tunix's orchestrator.
SAME_JOB_AS = {"maxtext": "tunix"}
# How far from an orchestrator's steps (its first record's time less its longest step, to its
# last record's) a trainer step's record may fall and still be that job's: a trainer closes its
# step on the same update its orchestrator's step ends with, a few milliseconds apart.
SLACK_S = 2.0


@dataclasses.dataclass(frozen=True)
class Process:
  """One process's records of one run, in step order: its figures as columns (`steps`), and
  where each step's record is (`files`, `lines`), read again only for the steps shown."""

  role: str
  host: str
  hostname: str
  pid: int
  run: str | None  # the run's id; None for version-1 records
  started: float  # Unix seconds (a version-1 record's: its first step's)
  stepping: float  # when its steps began: its first record's time less its longest step
  ended: float  # its last record's time
  steps: steps_lib.Steps
  lines: tuple[array, array]  # per step, its file (an index into `files`) and its line's offset
  files: tuple[str, ...]
  sources: tuple[str, ...]  # the paths given that its files came from

  @property
  def name(self) -> str:
    return f"{self.hostname}:{self.pid}"

  def records(self, last: int | None = None) -> list[dict[str, Any]]:
    """Its records, whole (its `last` steps'), read again from its files in step order."""
    file_of, offsets = self.lines
    first = 0 if last is None else max(0, len(offsets) - last)
    out: list[dict[str, Any]] = []
    while first < len(offsets):  # a file's run of lines at a time
      end = first
      while end < len(offsets) and file_of[end] == file_of[first]:
        end += 1
      out += record_lib.at(self.files[file_of[first]], offsets[first:end])
      first = end
    return out


@dataclasses.dataclass(frozen=True)
class Run:
  """One job's processes and their steps (each role's in step order, process by process)."""

  label: str  # what tells it apart: its start, its processes, the settings they ran with
  processes: tuple[Process, ...]
  started: float

  @functools.cached_property
  def trainer_steps(self) -> steps_lib.Steps:
    """The trainer's figures as columns (what the summary and the advice read)."""
    return self._steps(record_lib.TRAINER)

  @functools.cached_property
  def orchestrator_steps(self) -> steps_lib.Steps:
    return self._steps(record_lib.ORCHESTRATOR)

  def _steps(self, role: str) -> steps_lib.Steps:
    parts = [p.steps for p in self.processes if p.role == role]
    return steps_lib.Steps.joined(role, parts) if parts else steps_lib.Steps.of(role, [])

  def records(self, role: str, last: int | None = None) -> list[dict[str, Any]]:
    """Its records of `role`, whole (the `last` of them), read again from their files."""
    out: list[dict[str, Any]] = []
    for p in reversed([p for p in self.processes if p.role == role]):
      if last is not None and len(out) >= last:
        break
      out[:0] = p.records(None if last is None else last - len(out))
    return out

  @property
  def trainer(self) -> list[dict[str, Any]]:
    """Every trainer record, whole (a long run's cost: `trainer_steps` reads its figures)."""
    return self.records(record_lib.TRAINER)

  @property
  def orchestrator(self) -> list[dict[str, Any]]:
    return self.records(record_lib.ORCHESTRATOR)

  @property
  def sources(self) -> tuple[str, ...]:
    return tuple(dict.fromkeys(s for p in self.processes for s in p.sources))

  @property
  def files(self) -> tuple[str, ...]:
    return tuple(dict.fromkeys(f for p in self.processes for f in p.files))


def runs(paths: Iterable[str]) -> tuple[list[Run], list[str]]:
  """The runs the records `paths` name hold (a folder, or record files), in the order their steps
  began; and the notes on what was skipped or cut short. Raises record.RecordError (one line)
  for a path or a record that cannot be read."""
  sessions: dict[tuple[Any, ...], dict[str, Any]] = {}
  notes: list[str] = []
  seen: set[str] = set()
  collecting = gc.isenabled()
  gc.disable()  # millions of records hold no cycle: the collector's passes over them cost a fifth
  try:
    for source in paths:
      for path in record_lib.files([source], notes):
        if os.path.realpath(path) in seen:
          continue  # a file given twice (by name and in its folder) is read once
        seen.add(os.path.realpath(path))
        reader = record_lib.Reader(path)
        process = run = role = None  # the record before's; its session's appends
        for rec in reader:  # (the reader shares a process and run with the line before: `is`)
          if rec["process"] is not process or rec.get("run") is not run or rec["role"] != role:
            process, run, role = rec["process"], rec.get("run"), rec["role"]
            session = _session(sessions, rec)
            session["sources"][source] = None
            in_file = session["files"].setdefault(path, len(session["files"]))
            add, offset, file_of = (session["builder"].add, session["offsets"].append,
                                    session["file_of"].append)
          add(rec)
          offset(reader.offset)
          file_of(in_file)
        if reader.note is not None:
          notes.append(reader.note)
  finally:
    if collecting:
      gc.enable()
  processes = [_process(s) for s in sessions.values()]
  groups: list[list[Process]] = []
  for family in dict.fromkeys(_family(p.host) for p in processes):
    groups += _jobs([p for p in processes if _family(p.host) == family])
  groups.sort(key=lambda g: g[0].stepping)  # the runs in the order their steps began
  return [_run(g) for g in groups], notes


def _family(host: str) -> str:
  return SAME_JOB_AS.get(host, host)


def _jobs(members: list[Process]) -> list[list[Process]]:
  """One host family's processes as jobs: one per orchestrator run, each with the trainer steps
  that fall among its steps (a trainer that served one orchestrator after another is split
  between them); a trainer's steps near no orchestrator's are a run of their own."""
  orchestrators = sorted((p for p in members if p.role == record_lib.ORCHESTRATOR),
                         key=lambda p: (p.stepping, p.ended))
  jobs: list[list[Process]] = [[o] for o in orchestrators]
  host_steps = [set(o.steps.values("host_step")) - {None} for o in orchestrators]
  alone: list[list[Process]] = []
  for p in members:
    if p.role == record_lib.ORCHESTRATOR:
      continue
    parts: dict[int | None, list[int]] = {}
    for row, (time, host_step) in enumerate(zip(p.steps.columns["time"],
                                                 p.steps.values("host_step"))):
      parts.setdefault(_job_of(time, host_step, orchestrators, host_steps), []).append(row)
    for index, rows in parts.items():
      part = p if len(parts) == 1 else _part(p, rows)
      (alone.append([part]) if index is None else jobs[index].append(part))
  return jobs + alone


def _part(p: Process, rows: list[int]) -> Process:
  """The steps of `p` at `rows` (a trainer's steps of one job, where it served several)."""
  steps = p.steps.take(rows)
  pick = lambda c: array(c.typecode, operator.itemgetter(*rows)(c) if len(rows) > 1  # noqa: E731
                         else [c[rows[0]]])
  part = dataclasses.replace(p, steps=steps, lines=(pick(p.lines[0]), pick(p.lines[1])),
                             stepping=steps.columns["time"][0], ended=steps.columns["time"][-1])
  steps.last = part.records(1)[0]
  return part


def _job_of(time: float, host_step: int | None, orchestrators: list[Process],
            host_steps: list[set[int]]) -> int | None:
  """The orchestrator run a trainer step's record is of, or None. Where the host numbers its
  steps on both sides (tunix's train step, `host_step`), among the orchestrators that ran that
  step only; then the one whose steps its time falls among (the nearest, within SLACK_S; of two
  at once, the one begun last)."""
  candidates = range(len(orchestrators))
  if host_step is not None and any(host_steps):
    candidates = [i for i in candidates if host_step in host_steps[i]]
  best, nearest = None, SLACK_S
  for index in candidates:
    o = orchestrators[index]
    distance = max(o.stepping - time, time - o.ended, 0.0)
    if distance <= nearest:
      best, nearest = index, distance
  return best


def _session(sessions: dict[tuple[Any, ...], dict[str, Any]], rec: dict[str, Any]
             ) -> dict[str, Any]:
  """The session (a process's records of one run) `rec` belongs to."""
  run = rec.get("run")
  key = (rec["role"], rec["process"]["hostname"], rec["process"]["pid"],
         None if run is None else run["id"])
  if key not in sessions:
    sessions[key] = {"key": key, "host": rec["host"], "files": {}, "sources": {},
                     "builder": steps_lib.Builder(rec["role"]), "offsets": array("q"),
                     "file_of": array("H"), "started": None if run is None else run["started"]}
  return sessions[key]


def _process(s: dict[str, Any]) -> Process:
  role, hostname, pid, run = s["key"]
  steps, lines = s["builder"].steps(), (s["file_of"], s["offsets"])
  order = steps.columns["step"]
  if any(a > b for a, b in zip(order, order[1:])):  # in step order (a file's lines are)
    rows = sorted(range(len(order)), key=order.__getitem__)
    steps = steps.take(rows)
    lines = tuple(array(c.typecode, operator.itemgetter(*rows)(c)) for c in lines)
  times = steps.columns["time"]
  first = min(times)
  stepping = first - max((v for v in steps.columns["step_s"] if v == v), default=0.0)
  started = stepping if s["started"] is None else min(s["started"], first)
  process = Process(role=role, host=s["host"], hostname=hostname, pid=pid, run=run,
                    started=started, stepping=max(stepping, started), ended=max(times),
                    steps=steps, lines=lines, files=tuple(s["files"]),
                    sources=tuple(s["sources"]))
  steps.last = process.records(1)[0]
  return process


def _run(group: list[Process]) -> Run:
  group = sorted(group, key=lambda p: (p.role != record_lib.TRAINER, p.started, p.name))
  return Run(label=label(group), processes=tuple(group),
             started=min(p.started for p in group))


def when(seconds: float) -> str:
  """A Unix time as a date in UTC (one past the calendar's years as its seconds)."""
  try:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S UTC")
  except (ValueError, OverflowError, OSError):
    return f"{seconds:.0f} s after 1970 (UTC)"


def label(processes: list[Process]) -> str:
  """What tells a run apart: when it started, its processes, and the settings they ran with
  (each from the processes of the roles it is for, as their last record says; `a/b` where they
  differ; `auto` for one its process sized each step)."""
  started = min(p.started for p in processes)
  estimated = all(p.run is None for p in processes)
  head = f"{'about ' if estimated else ''}started {when(started)}"
  procs = ", ".join(f"{p.role} {p.name}" for p in processes)
  values: dict[str, dict[Any, None]] = {}
  for setting in record_lib.CARRIED:
    for p in processes:
      last = p.steps.last
      if p.role in setting.roles and setting.field in last["settings"]:
        sized = last.get("sizing") and record_lib.SIZED[p.role] == setting.field
        value = config_lib.AUTO if sized else last["settings"][setting.field]
        values.setdefault(setting.field, {})[value] = None
  settings = ", ".join(f"{field}={'/'.join(str(v) for v in vs)}"
                       for field, vs in values.items())
  return f"{head}; {procs}" + (f"; {settings}" if settings else "")
