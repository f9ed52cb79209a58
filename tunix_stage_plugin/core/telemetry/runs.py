"""A job's runs, told apart in its metrics records, so that a report never takes one median over
two jobs. A process's records of one run carry its run's id and start (record version 2; a
version-1 record's run is its process); a trainer's and an orchestrator's runs are one job's
when the times of their steps overlap (each from its first step to its last record) on hosts
that meet (tunix's orchestrator and the trainers behind tunix's worker; the embedded host's two).
docs/observability.md "tunix-stage report".
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
from typing import Any, Iterable

from tunix_stage_plugin.core.telemetry import record as record_lib

# The hosts a trainer's record may name behind the orchestrator's: MaxText's engine runs behind
# tunix's worker, driven by tunix's orchestrator.
SAME_JOB_AS = {"maxtext": "tunix"}
# When a process's steps began: its first record's time less its longest step and this (a run
# may start long before its first step: a trainer waits for its orchestrator).
SLACK_S = 2.0


@dataclasses.dataclass(frozen=True)
class Process:
  """One process's records of one run, in step order."""

  role: str
  host: str
  hostname: str
  pid: int
  run: str | None  # the run's id; None for version-1 records
  started: float  # Unix seconds (a version-1 record's: its first step's)
  stepping: float  # when its steps began (SLACK_S)
  ended: float  # its last record's time
  records: list[dict[str, Any]]
  files: tuple[str, ...]
  sources: tuple[str, ...]  # the paths given that its files came from

  @property
  def name(self) -> str:
    return f"{self.hostname}:{self.pid}"


@dataclasses.dataclass(frozen=True)
class Run:
  """One job's processes and their records (each role's in step order, process by process)."""

  label: str  # what tells it apart: its start, its processes, the settings they ran with
  trainer: list[dict[str, Any]]
  orchestrator: list[dict[str, Any]]
  processes: tuple[Process, ...]
  started: float

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
        held: tuple[Any, ...] = ()  # the role, process and run of the record before; its session
        for rec in reader:  # (the reader shares a process and run with the line before: `is`)
          if held[:3] != (rec["role"], rec["process"], rec.get("run")):
            held = (rec["role"], rec["process"], rec.get("run"), _session(sessions, rec))
            held[3]["files"][path] = held[3]["sources"][source] = None
          held[3]["records"].append(rec)
        if reader.note is not None:
          notes.append(reader.note)
  finally:
    if collecting:
      gc.enable()
  processes = [_process(s) for s in sessions.values()]
  groups: list[list[Process]] = []
  for family in dict.fromkeys(_family(p.host) for p in processes):
    members = sorted((p for p in processes if _family(p.host) == family),
                     key=lambda p: (p.stepping, p.ended))
    end = None
    for p in members:  # overlapping steps are one job's
      if end is None or p.stepping > end:
        groups.append([])
        end = p.ended
      groups[-1].append(p)
      end = max(end, p.ended)
  groups.sort(key=lambda g: g[0].stepping)  # the runs in the order their steps began
  return [_run(g) for g in groups], notes


def _family(host: str) -> str:
  return SAME_JOB_AS.get(host, host)


def _session(sessions: dict[tuple[Any, ...], dict[str, Any]], rec: dict[str, Any]
             ) -> dict[str, Any]:
  """The session (a process's records of one run) `rec` belongs to."""
  run = rec.get("run")
  key = (rec["role"], rec["process"]["hostname"], rec["process"]["pid"],
         None if run is None else run["id"])
  if key not in sessions:
    sessions[key] = {"key": key, "host": rec["host"], "records": [], "files": {},
                     "sources": {}, "started": None if run is None else run["started"]}
  return sessions[key]


def _process(s: dict[str, Any]) -> Process:
  role, hostname, pid, run = s["key"]
  times = [r["time"] for r in s["records"]]
  first = min(times)
  stepping = first - max(r["step_s"] or 0.0 for r in s["records"]) - SLACK_S
  started = stepping if s["started"] is None else min(s["started"], first)
  records = sorted(s["records"], key=lambda r: r["step"])
  return Process(role=role, host=s["host"], hostname=hostname, pid=pid, run=run,
                 started=started, stepping=max(stepping, started), ended=max(times),
                 records=records, files=tuple(s["files"]), sources=tuple(s["sources"]))


def _run(group: list[Process]) -> Run:
  group = sorted(group, key=lambda p: (p.role != record_lib.TRAINER, p.started, p.name))
  return Run(label=label(group), processes=tuple(group),
             started=min(p.started for p in group),
             trainer=[r for p in group if p.role == record_lib.TRAINER for r in p.records],
             orchestrator=[r for p in group if p.role == record_lib.ORCHESTRATOR
                           for r in p.records])


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
  differ)."""
  started = min(p.started for p in processes)
  estimated = all(p.run is None for p in processes)
  head = f"{'about ' if estimated else ''}started {when(started)}"
  procs = ", ".join(f"{p.role} {p.name}" for p in processes)
  values: dict[str, dict[Any, None]] = {}
  for setting in record_lib.CARRIED:
    for p in processes:
      if p.role in setting.roles and setting.field in p.records[-1]["settings"]:
        values.setdefault(setting.field, {})[p.records[-1]["settings"][setting.field]] = None
  settings = ", ".join(f"{field}={'/'.join(str(v) for v in vs)}"
                       for field, vs in values.items())
  return f"{head}; {procs}" + (f"; {settings}" if settings else "")
