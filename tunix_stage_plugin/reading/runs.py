"""A job's runs, told apart in its metrics records, so that a report never takes one median over
two jobs. A process's records of one run carry its run's id and start (record version 2; a
version-1 record's run is its process). An orchestrator's run is one job (the orchestrator
drives it); each trainer step's record joins the job whose orchestrator ran that step (tunix's
train step, on both sides) and whose steps it falls among in time, on hosts that meet (tunix's
orchestrator and the trainers behind tunix's worker; the embedded host's two): two jobs one
after the other are two, however close. A trainer step of no orchestrator's is a run of its
trainer alone. docs/observability.md "tunix-stage report".
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
from typing import Any, Iterable

import numpy as np
import pandas as pd

from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core.telemetry import record as record_lib
from tunix_stage_plugin.reading import records as records_lib

# The hosts a trainer's record may name behind the orchestrator's: MaxText's engine runs behind
# tunix's worker, driven by tunix's orchestrator.
SAME_JOB_AS = {"maxtext": "tunix"}
# How far from an orchestrator's steps (its first record's time less its longest step, to its
# last record's) a trainer step's record may fall and still be that job's: a trainer closes its
# step on the same update its orchestrator's step ends with, a few milliseconds apart.
SLACK_S = 2.0


@dataclasses.dataclass(frozen=True)
class Process:
  """One process's steps of one run, in step order (`rows`: their positions in its role's
  table), and the files they came from."""

  role: str
  host: str
  hostname: str
  pid: int
  run: str | None  # the run's id; None for version-1 records
  started: float  # Unix seconds (a version-1 record's: its first step's)
  stepping: float  # when its steps began: its first record's time less its longest step
  ended: float  # its last record's time
  steps: pd.DataFrame  # its rows of its role's table
  files: tuple[str, ...]
  sources: tuple[str, ...]  # the paths given that its files came from

  @property
  def name(self) -> str:
    return f"{self.hostname}:{self.pid}"

  @property
  def last(self) -> pd.Series:
    """Its last step's row (what names its settings)."""
    return self.steps.iloc[-1]


@dataclasses.dataclass(frozen=True)
class Run:
  """One job's processes and their steps (each role's in step order, process by process)."""

  label: str  # what tells it apart: its start, its processes, the settings they ran with
  processes: tuple[Process, ...]
  started: float

  @functools.cached_property
  def trainer_steps(self) -> pd.DataFrame:
    """The trainer's steps (what the summary and the advice read)."""
    return self._steps(record_lib.TRAINER)

  @functools.cached_property
  def orchestrator_steps(self) -> pd.DataFrame:
    return self._steps(record_lib.ORCHESTRATOR)

  def steps(self, role: str) -> pd.DataFrame:
    """`role`'s steps, process after process."""
    return self.trainer_steps if role == record_lib.TRAINER else self.orchestrator_steps

  def _steps(self, role: str) -> pd.DataFrame:
    parts = [p.steps for p in self.processes if p.role == role]
    if len(parts) == 1:
      return parts[0]
    if not parts:
      return records_lib.empty(role)
    return pd.concat(parts, ignore_index=True)

  @property
  def sources(self) -> tuple[str, ...]:
    return tuple(dict.fromkeys(s for p in self.processes for s in p.sources))

  @property
  def files(self) -> tuple[str, ...]:
    return tuple(dict.fromkeys(f for p in self.processes for f in p.files))


def runs(paths: Iterable[str]) -> tuple[list[Run], list[str]]:
  """The runs the records `paths` name hold (a folder, or record files), in the order their steps
  began; and the notes on what was skipped or cut short. Raises records.RecordError (one line)
  for a path or a record that cannot be read."""
  found = records_lib.read(paths)
  return of(found), found.notes


def of(found: records_lib.Records) -> list[Run]:
  """The runs of records read (records.read's)."""
  processes = [p for role, frame in found.steps.items() for p in _processes(role, frame, found)]
  groups: list[list[Process]] = []
  for family in dict.fromkeys(_family(p.host) for p in processes):
    groups += _jobs([p for p in processes if _family(p.host) == family])
  groups.sort(key=lambda g: g[0].stepping)  # the runs in the order their steps began
  return [_run(g) for g in groups]


def _processes(role: str, frame: pd.DataFrame, found: records_lib.Records) -> list[Process]:
  """Each process's run of `frame` (a role's table, sorted by process, run and step)."""
  if not len(frame):
    return []
  keys = frame[["hostname", "pid", "run"]]
  starts = np.flatnonzero(np.r_[True, (keys.iloc[1:].to_numpy() != keys.iloc[:-1].to_numpy())
                                .any(axis=1) & ~_same_null_run(frame)])
  out = []
  for begin, end in zip(starts, [*starts[1:], len(frame)]):
    steps = frame.iloc[begin:end]
    out.append(_process(role, steps, found))
  return out


def _same_null_run(frame: pd.DataFrame) -> np.ndarray:
  """Between consecutive rows: both version-1 rows (no run, NaN) of the same process."""
  run = frame["run"]
  null = run.isna().to_numpy()
  same = ((frame["hostname"].to_numpy()[1:] == frame["hostname"].to_numpy()[:-1])
          & (frame["pid"].to_numpy()[1:] == frame["pid"].to_numpy()[:-1]))
  return null[1:] & null[:-1] & same


def _process(role: str, steps: pd.DataFrame, found: records_lib.Records) -> Process:
  last = steps.iloc[-1]
  times = steps["time"].to_numpy()
  first = float(times.min())
  longest = steps["step_s"].max()
  stepping = first - (0.0 if pd.isna(longest) else float(longest))
  run = None if pd.isna(last["run"]) else str(last["run"])
  started = stepping if run is None else min(float(steps["run_started"].min()), first)
  files = tuple(found.files[i] for i in dict.fromkeys(steps["file"].tolist()))
  sources = tuple(dict.fromkeys(found.sources[found.files.index(f)] for f in files))
  return Process(role=role, host=str(last["host"]), hostname=str(last["hostname"]),
                 pid=int(last["pid"]), run=run, started=started,
                 stepping=max(stepping, started), ended=float(times.max()), steps=steps,
                 files=files, sources=sources)


def _family(host: str) -> str:
  return SAME_JOB_AS.get(host, host)


def _jobs(members: list[Process]) -> list[list[Process]]:
  """One host family's processes as jobs: one per orchestrator run, each with the trainer steps
  that fall among its steps (a trainer that served one orchestrator after another is split
  between them); a trainer's steps near no orchestrator's are a run of their own."""
  orchestrators = sorted((p for p in members if p.role == record_lib.ORCHESTRATOR),
                         key=lambda p: (p.stepping, p.ended))
  jobs: list[list[Process]] = [[o] for o in orchestrators]
  host_steps = [set(o.steps["host_step"].dropna().astype(np.int64).tolist())
                for o in orchestrators]
  alone: list[list[Process]] = []
  for p in members:
    if p.role == record_lib.ORCHESTRATOR:
      continue
    job = _job_of(p.steps["time"].to_numpy(), p.steps["host_step"].to_numpy(), orchestrators,
                  host_steps)
    for index in dict.fromkeys(job.tolist()):
      rows = np.flatnonzero(job == index)
      part = p if len(rows) == len(p.steps) else _part(p, rows)
      (alone.append([part]) if index < 0 else jobs[index].append(part))
  return jobs + alone


def _part(p: Process, rows: np.ndarray) -> Process:
  """The steps of `p` at `rows` (a trainer's steps of one job, where it served several)."""
  steps = p.steps.iloc[rows]
  times = steps["time"].to_numpy()
  return dataclasses.replace(p, steps=steps, stepping=float(times[0]), ended=float(times[-1]))


def _job_of(times: np.ndarray, host_step: np.ndarray, orchestrators: list[Process],
            host_steps: list[set[int]]) -> np.ndarray:
  """Per trainer step, the orchestrator run its record is of (an index), or -1. Where the host
  numbers its steps on both sides (tunix's train step, `host_step`), among the orchestrators that
  ran that step only, and within that orchestrator's longest step of its steps (a trainer closes
  its step when the update's computation ends, which a busy machine may hold back after the
  orchestrator's step ended); else the one whose steps its time falls among, within SLACK_S. Of
  several, the nearest (of two at once, the one begun last)."""
  best = np.full(len(times), -1)
  nearest = np.full(len(times), np.inf)
  numbered = any(host_steps)
  for index, o in enumerate(orchestrators):
    distance = np.maximum(np.maximum(o.stepping - times, times - o.ended), 0.0)
    allowed = np.full(len(times), SLACK_S)
    if numbered:
      ran = np.isin(host_step, np.fromiter(host_steps[index], dtype=np.float64))
      longest = o.steps["step_s"].max()
      allowed = np.where(ran, max(SLACK_S, 0.0 if pd.isna(longest) else float(longest)),
                         np.where(np.isnan(host_step), SLACK_S, -1.0))
    closer = (distance <= allowed) & (distance <= nearest)
    best = np.where(closer, index, best)
    nearest = np.where(closer, distance, nearest)
  return best


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


def setting(row: pd.Series, field: str) -> Any:
  """A setting a step's row says it ran with, or the settings table's default where it lacks
  one (an older record, a role the setting is not for; a sized one's fixed value)."""
  value = row[field]
  if pd.isna(value):
    return config_lib.fixed(field, config_lib.SETTINGS_BY_FIELD[field].default)
  return int(value) if isinstance(value, (float, np.floating, np.integer)) else value


def label(processes: list[Process]) -> str:
  """What tells a run apart: when it started, its processes, and the settings they ran with
  (each from the processes of the roles it is for, as their last step says; `a/b` where they
  differ; `auto` for one its process sized each step)."""
  started = min(p.started for p in processes)
  estimated = all(p.run is None for p in processes)
  head = f"{'about ' if estimated else ''}started {when(started)}"
  procs = ", ".join(f"{p.role} {p.name}" for p in processes)
  values: dict[str, dict[Any, None]] = {}
  for s in record_lib.CARRIED:
    for p in processes:
      last = p.last
      if p.role in s.roles and not pd.isna(last[s.field]):
        sized = isinstance(last["sizing"], str) and record_lib.SIZED[p.role] == s.field
        value = config_lib.AUTO if sized else setting(last, s.field)
        values.setdefault(s.field, {})[value] = None
  settings = ", ".join(f"{field}={'/'.join(str(v) for v in vs)}"
                       for field, vs in values.items())
  return f"{head}; {procs}" + (f"; {settings}" if settings else "")
