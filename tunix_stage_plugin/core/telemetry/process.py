"""One staging process's telemetry: its recorder, and for each side it plays (trainer,
orchestrator) the step aggregator, the record file and the per-step line; each side's step
figures also go to its step sinks (the trainer's own metrics logger, the orchestrator's
jax.monitoring listeners). The host's installation owns it; with staging off none is made.
docs/observability.md.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, Protocol

from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import contract
from tunix_stage_plugin.core.telemetry import lines
from tunix_stage_plugin.core.telemetry import record as record_lib
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib


@dataclasses.dataclass(frozen=True)
class Settings:
  """What shapes the telemetry (the staging settings' metrics and log interval) and what each
  record says shaped the figures (the depths and bounds in force)."""

  host: str
  metrics_dir: str | None = None  # TUNIX_STAGE_METRICS; None: no record
  log_every: int = 1  # TUNIX_STAGE_LOG_EVERY; 0: no line
  shaping: tuple[tuple[str, Any], ...] = ()  # the settings each record carries (record.CARRIED)

  @classmethod
  def of(cls, host: str, config: Any) -> "Settings":
    """From a core.config.StageConfig: its metrics folder and log interval, and the settings
    that shape the figures."""
    return cls(host=host, metrics_dir=config.metrics or None, log_every=config.log_every,
               shaping=tuple((s.field, getattr(config, s.field)) for s in record_lib.CARRIED))


class StepSink(Protocol):
  """Told of each step's figures of one side (on the thread that closed the step; keep it
  short)."""

  def step(self, figures: dict[str, Any]) -> None:
    ...


HISTORY = 1024  # recent records kept per side in memory


class Telemetry:

  def __init__(self, settings: Settings) -> None:
    self.settings = settings
    self.recorder = recorder_lib.Recorder()
    self._lock = threading.Lock()
    self._trainer: recorder_lib.TrainerSteps | None = None
    self._orchestrator: recorder_lib.OrchestratorSteps | None = None
    self._trainer_host = settings.host
    self._writers: dict[str, record_lib.Writer] = {}
    self.run = record_lib.new_run()  # what tells this run's records apart from another's
    self._step_sinks: dict[str, tuple[StepSink, ...]] = {role: () for role in record_lib.ROLES}
    # Each side's recent records (the bench compares them with its own figures).
    self.history: dict[str, collections.deque[dict[str, Any]]] = {
        role: collections.deque(maxlen=HISTORY) for role in record_lib.ROLES}
    # A depth or bound sized each step (auto): its value in force and each role's last choice.
    self._in_force: dict[str, int] = {}
    self._sizing: dict[str, str] = {}
    # The trainer's newest closed step with the bounds in force (None before its first step):
    # what rides on its stage answers, made once per step.
    self.newest_trainer_step: contract.TrainerStep | None = None

  def sized(self, role: str, field: str, value: int, reason: str | None) -> None:
    """`field` (a setting at auto) is `value` from now on, for `reason`: the records of `role`
    carry the value in force and the reason (`sizing`), its per-step line says it; no `reason`:
    a run that holds it fixed (nothing said)."""
    with self._lock:
      self._in_force[field] = value
      if reason is None:
        self._sizing.pop(role, None)
      else:
        self._sizing[role] = reason

  def configure(self, settings: Settings) -> None:
    """New settings (a re-install): the next records follow them (a depth or bound no longer
    at auto: no more choices said)."""
    with self._lock:
      auto = {field for field, value in settings.shaping if config_lib.is_auto(value)}
      self._in_force = {f: v for f, v in self._in_force.items() if f in auto}
      self._sizing = {role: why for role, why in self._sizing.items()
                      if record_lib.SIZED[role] in auto}
      if settings.metrics_dir != self.settings.metrics_dir:
        for writer in self._writers.values():
          writer.close()
        self._writers = {}
      self.settings = settings

  def trainer(self, peaks: recorder_lib.Peaks | None = None,
              host: str | None = None) -> recorder_lib.TrainerSteps:
    """The trainer side's aggregator, made (and listening) on first use; `host`, when given,
    names the trainer's kind in its records from now on (the settings' host by default)."""
    with self._lock:
      if self._trainer is None:
        self._trainer = recorder_lib.TrainerSteps(self._trainer_step, peaks)
        self.recorder.add_sink(self._trainer)
      if host is not None:
        self._trainer_host = host
      return self._trainer

  def restart(self) -> None:
    """A new run in the same process (the bench's modes): each side listening starts again from
    step 0, its history empty, its records a new run's (in a file of their own). The trainer
    keeps its computations' baseline alone (the same process's model), so a run whose every
    fwd_bwd has a transfer beside it still has one."""
    with self._lock:
      if self._trainer is not None:
        old, self._trainer = self._trainer, recorder_lib.TrainerSteps(
            self._trainer_step, self._trainer.peaks, alone=self._trainer.alone())
        self.recorder.remove_sink(old)
        self.recorder.add_sink(self._trainer)
      if self._orchestrator is not None:
        old, self._orchestrator = self._orchestrator, recorder_lib.OrchestratorSteps()
        self.recorder.remove_sink(old)
        self.recorder.add_sink(self._orchestrator)
      for history in self.history.values():
        history.clear()
      self.newest_trainer_step = None
      self.run = record_lib.new_run()
      writers, self._writers = list(self._writers.values()), {}
    for writer in writers:
      writer.close()

  def orchestrator(self) -> recorder_lib.OrchestratorSteps:
    with self._lock:
      if self._orchestrator is None:
        self._orchestrator = recorder_lib.OrchestratorSteps()
        self.recorder.add_sink(self._orchestrator)
      return self._orchestrator

  def orchestrator_step(self, report: Any, depth: int, note: str = "",
                        host_step: int | None = None) -> dict[str, Any]:
    """A step's figures on the orchestrator (`report`: a core.pipeline.StepReport); written and
    said like the trainer's. `note` ends the line (e.g. what a codec saved); `host_step` is the
    trainer's own step count its last update answered, where the host's answer carries one."""
    figures = self._with_sizing(record_lib.ORCHESTRATOR,
                                self.orchestrator().step(report, depth, host_step))
    self._emit(record_lib.ORCHESTRATOR, figures, lines.orchestrator_line(figures) + note)
    return figures

  def add_step_sink(self, sink: StepSink, role: str = record_lib.TRAINER) -> None:
    """Tells `sink` each step's figures of `role` from now on; one that raises is dropped, said
    once (telemetry never fails a job)."""
    with self._lock:
      self._step_sinks[role] = (*self._step_sinks[role], sink)

  def _with_sizing(self, role: str, figures: dict[str, Any]) -> dict[str, Any]:
    with self._lock:
      reason = self._sizing.get(role)
    return figures if reason is None else {**figures, "sizing": reason}

  def _trainer_step(self, figures: dict[str, Any]) -> None:
    figures = self._with_sizing(record_lib.TRAINER, figures)
    self._emit(record_lib.TRAINER, figures, lines.trainer_line(figures), self._trainer_host)

  def _emit(self, role: str, figures: dict[str, Any], line: str, host: str | None = None
            ) -> None:
    settings = self.settings
    with self._lock:
      shaping = {field: self._in_force.get(field, value) if config_lib.is_auto(value) else value
                 for field, value in settings.shaping
                 if role in config_lib.SETTINGS_BY_FIELD[field].roles}
      if role == record_lib.TRAINER:
        bound = {field: config_lib.fixed(field, shaping.get(
            field, config_lib.SETTINGS_BY_FIELD[field].default))
                 for field in ("max_device_batches", "max_host_batches")}
        self.newest_trainer_step = contract.TrainerStep.of(
            figures, run=self.run["id"], host_sized="sizing" in figures, **bound)
      rec = record_lib.make(role, host or settings.host, figures, shaping, self.run)
      self.history[role].append(rec)
      writer = None
      if settings.metrics_dir is not None:
        writer = self._writers.get(role)
        if writer is None:
          writer = self._writers[role] = record_lib.Writer(settings.metrics_dir, role,
                                                           self.run["id"])
    if writer is not None:
      writer.write(rec)
    lines.say(figures["step"], settings.log_every, line)
    for sink in self._step_sinks[role]:
      try:
        sink.step(figures)
      except Exception as e:  # pylint: disable=broad-except  (telemetry never fails a job)
        with self._lock:
          self._step_sinks[role] = tuple(s for s in self._step_sinks[role] if s is not sink)
        recorder_lib.say_dropped(sink, e)

  def close(self) -> None:
    with self._lock:
      writers, self._writers = list(self._writers.values()), {}
      self._step_sinks = {role: () for role in self._step_sinks}
    for writer in writers:
      writer.close()
