"""Staging's step figures where tunix users already look: on the trainer, its own metrics logger
(the `MetricsLogger` a tunix PeftTrainer creates or is given, `metrics_logger`), so its backends
(TensorBoard through metrax, W&B, CLU) and, with `enable_opentelemetry`, its OpenTelemetry
gauges show `stage/...` beside the loss, at the step the loss is logged at; on the orchestrator,
which has no logger of tunix's, the process's jax.monitoring listeners (where every such logger's
backends listen), at the same step. The names: core/telemetry/figures.py.
docs/observability.md "In your metrics logger".
"""

from __future__ import annotations

from typing import Any

import jax
from tunix.sft import metrics_logger as metrics_logger_lib

from tunix_stage_plugin.core.telemetry import figures as figures_lib


def logger_of(trainer: Any) -> metrics_logger_lib.MetricsLogger | None:
  """The MetricsLogger a PeftTrainer logs its loss with, or None (a logger of another kind)."""
  logger = trainer.metrics_logger
  return logger if isinstance(logger, metrics_logger_lib.MetricsLogger) else None


class MetricsSink:
  """A step sink (core.telemetry.process.StepSink): each trainer step's scalars through
  `logger.log`, under the trainer's metrics prefix and in train mode (tags
  `<prefix>/train/stage/...`), at the step the host's update answered: tunix's `train_steps`
  after it, where PeftTrainer logs the loss of that update's micro-batches."""

  def __init__(self, logger: metrics_logger_lib.MetricsLogger, prefix: str) -> None:
    self.logger = logger
    self.prefix = prefix

  def step(self, figures: dict[str, Any]) -> None:
    step = figures["host_step"]
    if step is None:  # the update answered no step: no step of the loss's to sit at
      return
    for name, value in figures_lib.scalars(figures_lib.TRAINER, figures).items():
      self.logger.log(self.prefix, name, value, metrics_logger_lib.Mode.TRAIN, step)


class MonitoringSink:
  """A step sink of the orchestrator's figures: each step's scalars through
  `jax.monitoring.record_scalar` (names `stage/...`), at the trainer's step count the step's
  last update answered (tunix's `train_step`, where the trainer logs that update's loss), or at
  the orchestrator's own step where the answer carried none."""

  def step(self, figures: dict[str, Any]) -> None:
    step = figures["step"] if figures["host_step"] is None else figures["host_step"]
    for name, value in figures_lib.scalars(figures_lib.ORCHESTRATOR, figures).items():
      jax.monitoring.record_scalar(name, value, step=step)
