"""Staging's step figures in tunix's own MetricsLogger (hosts/tunix/peft.py), against the real
class: what it logs, under which names, at which step, and what a logger that raises costs; the
orchestrator's figures through jax.monitoring (MonitoringSink), to a real listener.
The real two-process job writing TensorBoard files: test_observability.py.
"""

from __future__ import annotations

import logging
import types

import pytest

pytest.importorskip("tunix.sft.metrics_logger", reason="tunix is not importable")

import jax  # pylint: disable=wrong-import-position
from tunix.sft import metrics_logger as metrics_logger_lib  # pylint: disable=wrong-import-position

from tests.core.test_telemetry import compute  # pylint: disable=wrong-import-position
from tunix_stage_plugin.core.pipeline import StepReport  # pylint: disable=wrong-import-position
from tunix_stage_plugin.core.telemetry import process  # pylint: disable=wrong-import-position
from tunix_stage_plugin.core.telemetry import record as record_lib  # pylint: disable=wrong-import-position
from tunix_stage_plugin.core.telemetry import figures as figures_lib  # pylint: disable=wrong-import-position
from tunix_stage_plugin.hosts.tunix import peft as metrics  # pylint: disable=wrong-import-position
from tunix_stage_plugin.hosts.tunix import run as run_lib

pytestmark = pytest.mark.tunix


def scalar_names(role):
  """The full names of `role`'s scalars (figures.FIGURES' `scalar`)."""
  return {figures_lib.PREFIX + f.name for f in figures_lib.FIGURES if f.role == role and f.scalar}


@pytest.fixture
def logged():
  """What reaches jax.monitoring (where a MetricsLogger's backends listen): (tag, value, step)."""
  seen = []

  def listen(event, value, **kwargs):
    seen.append((event, float(value), kwargs.get("step")))

  jax.monitoring.register_scalar_listener(listen)
  yield seen
  jax.monitoring.unregister_scalar_listener(listen)


def run_steps(tel, host_steps):
  for n, host_step in enumerate(host_steps):
    args = {} if host_step is None else {"host_step": host_step}
    for span in (compute("fwd_bwd", 2.0 * n, 2.0 * n + 1.0),
                 compute("update", 2.0 * n + 1.0, 2.0 * n + 1.1, **args)):
      tel.recorder.add(span.track, span.name, span.start, span.end, **dict(span.args))


def test_each_step_s_scalars_go_to_the_trainer_s_logger_at_the_step_its_update_answered(logged):
  logger = metrics_logger_lib.MetricsLogger()  # no backends: its history and jax.monitoring
  trainer = types.SimpleNamespace(metrics_logger=logger, metrics_prefix="actor")
  assert metrics.logger_of(trainer) is logger
  assert metrics.logger_of(types.SimpleNamespace(metrics_logger=object())) is None
  tel = process.Telemetry(process.Settings(host="tunix", log_every=0))
  tel.trainer()
  tel.add_step_sink(metrics.MetricsSink(logger, "actor"))
  run_steps(tel, [11, None, 12])  # a step whose update answered no step is not logged
  mine = [e for e in logged if "/stage/" in e[0]]
  assert {step for _, _, step in mine} == {11, 12}
  names = {tag for tag, _, _ in mine}
  assert names <= {f"actor/train/{name}" for name in scalar_names(figures_lib.TRAINER)}
  assert "actor/train/stage/compute_s" in names and "actor/train/stage/bound_by_compute" in names
  assert [s for tag, _, s in mine if tag == "actor/train/stage/compute_s"] == [11, 12]
  # tunix's own history holds them too, in train mode, as its loss would be.
  assert list(logger.get_metric_history("actor", "stage/compute_s", "train")) == \
      pytest.approx([1.1, 1.1])
  tel.close()


def test_a_logger_that_raises_is_said_once_and_dropped_and_the_job_goes_on(logged, caplog):

  class Failing(metrics_logger_lib.MetricsLogger):
    def log(self, *args, **kwargs):
      raise RuntimeError("backend gone")

  tel = process.Telemetry(process.Settings(host="tunix", log_every=0))
  tel.trainer()
  tel.add_step_sink(metrics.MetricsSink(Failing(), ""))
  with caplog.at_level(logging.WARNING, logger="tunix_stage_plugin"):
    run_steps(tel, [1, 2, 3])
  assert [r.message for r in caplog.records] == [
      "tunix-stage: telemetry: MetricsSink failed (RuntimeError: backend gone) and was dropped; "
      "staging goes on"]
  assert len(tel.history["trainer"]) == 3  # every step still made its figures and record
  assert not [e for e in logged if "stage/" in e[0]]
  tel.close()


def test_with_opentelemetry_on_the_same_scalars_arrive_as_tunix_s_gauges():
  """tunix's double-write (`enable_opentelemetry`): each stage scalar is a gauge named as tunix
  names a metric it does not know (`tunix.stage.<name>`), in train mode, read here by an
  in-memory OpenTelemetry reader given to the logger."""
  sdk_metrics = pytest.importorskip("opentelemetry.sdk.metrics")
  export = pytest.importorskip("opentelemetry.sdk.metrics.export")
  reader = export.InMemoryMetricReader()
  backend = types.SimpleNamespace(log_scalar=lambda *args, **kwargs: None, close=lambda: None)
  logger = metrics_logger_lib.MetricsLogger(
      metrics_logger_lib.MetricsLoggerOptions(log_dir="unused", enable_opentelemetry=True,
                                              backend_kwargs={"custom_backend": [lambda: backend]}),
      otel_meter_provider=sdk_metrics.MeterProvider(metric_readers=[reader]))
  jax.monitoring.unregister_scalar_listener(backend.log_scalar)  # only the gauges are read here
  tel = process.Telemetry(process.Settings(host="tunix", log_every=0))
  tel.trainer()
  tel.add_step_sink(metrics.MetricsSink(logger, ""))
  run_steps(tel, [1, 2])
  points = {m.name: [(dict(p.attributes), p.value) for p in m.data.data_points]
            for rm in reader.get_metrics_data().resource_metrics
            for sm in rm.scope_metrics for m in sm.metrics}
  assert points["tunix.stage.compute_s"] == [({"tunix.training.mode": "train"},
                                               pytest.approx(1.1))]
  assert {f"tunix.{figures_lib.PREFIX.replace('/', '.')}{name}" for name in (
      "compute_s", "input_wait_mid_step_s", "placed_staged", "bound_by_compute")} <= set(points)
  assert points["tunix.training.step"] == [({"tunix.training.mode": "train"}, 2)]
  tel.close()


def test_the_orchestrator_s_scalars_reach_jax_monitoring_listeners_at_the_trainer_s_step(
    logged, caplog):
  """Each orchestrator step's `stage/...` scalars go to the process's jax.monitoring listeners
  at the trainer's step its last update answered (the orchestrator's own step where the answer
  carried none); a listener that raises is said once and no longer told, and the job goes on."""
  tel = process.Telemetry(process.Settings(host="tunix", log_every=0))
  tel.add_step_sink(run_lib.MonitoringSink(), record_lib.ORCHESTRATOR)
  tel.orchestrator_step(StepReport(0, trained=4, staged=3, inline=1), 2, host_step=11)
  tel.orchestrator_step(StepReport(1, trained=4, staged=4), 2, host_step=12)
  tel.orchestrator_step(StepReport(2, trained=4, staged=4), 2)  # no step answered: its own
  mine = [e for e in logged if e[0].startswith(figures_lib.PREFIX)]
  # Every name of the table but the stage calls' median (no stage call spans here: unknown).
  assert {name for name, _, _ in mine} == scalar_names(figures_lib.ORCHESTRATOR) - {
      "stage/stage_call_median_s"}
  assert [(v, s) for name, v, s in mine if name == "stage/staged"] == [(3, 11), (4, 12), (4, 2)]

  def broken(event, value, **kwargs):
    raise RuntimeError("listener gone")

  jax.monitoring.register_scalar_listener(broken)
  try:
    with caplog.at_level(logging.WARNING, logger="tunix_stage_plugin"):
      for step in (3, 4):
        tel.orchestrator_step(StepReport(step, trained=4, staged=4), 2, host_step=step)
  finally:
    jax.monitoring.unregister_scalar_listener(broken)
  assert [r.message for r in caplog.records] == [
      "tunix-stage: telemetry: MonitoringSink failed (RuntimeError: listener gone) and was "
      "dropped; staging goes on"]
  assert len(tel.history["orchestrator"]) == 5  # every step still made its figures
  tel.close()
