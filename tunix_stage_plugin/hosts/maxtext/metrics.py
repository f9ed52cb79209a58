"""Staging's step figures where a MaxText user already looks: the engine's own metrics logger
(`MaxTextTrainingEngine._metrics_logger`, which writes `train/<name>` to its TensorBoard
writer), as `train/stage/...` beside the loss, at the step MaxText logs that update's loss at;
where the engine has no writer (`enable_tensorboard=False`, or not process 0), the process's
jax.monitoring listeners get them under the same names. The names: core/telemetry/figures.py.
docs/observability.md "In your metrics logger".
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import jax

from tunix_stage_plugin.core.telemetry import figures as figures_lib


def logger_of(module: ModuleType, engine: Any) -> Any:
  """The engine's own MetricsLogger (maxtext.training_engine.metrics), or None."""
  logger = engine._metrics_logger  # pylint: disable=protected-access
  return logger if isinstance(logger, module.metrics_module.MetricsLogger) else None


class EngineSink:
  """A step sink (core.telemetry.process.StepSink): each trainer step's scalars through the
  engine's logger's TensorBoard writing (its `train/` tags, its process-0 rule and flush
  cadence), else through jax.monitoring, at the update's step less one: MaxText buffers a
  step's loss under its train_step before the update, and the update answers the count after."""

  def __init__(self, module: ModuleType, logger: Any) -> None:
    self.mode = module.metrics_module.Mode.TRAIN
    self.logger = logger

  def step(self, figures: dict[str, Any]) -> None:
    if figures["host_step"] is None:  # the update answered no step: none of the loss's to sit at
      return
    step, values = figures["host_step"] - 1, figures_lib.scalars(figures_lib.TRAINER, figures)
    if self.logger._tb_writer is not None:  # pylint: disable=protected-access
      self.logger._write_metrics_to_tensorboard(step=step, metrics=values, mode=self.mode)  # pylint: disable=protected-access
      return
    for name, value in values.items():
      jax.monitoring.record_scalar(f"{self.mode}/{name}", value, step=step)
