"""The embedded host as a bench host (lab/bench/host.py): one trainer process of the plugin's own
(lab/embedded), its links emulated and calibrated from the measured compute time c (wire
--wire_ratio x c, host-to-device --h2d_ratio x c, weight sync --sync_ratio x c), the transfer
scenarios, and the stage pipeline's job loop. docs/bench.md "What runs".
"""

from __future__ import annotations

import gc
import os
import time
from typing import Callable

import numpy as np

from tunix_stage_plugin.lab.bench import trace as trace_lib
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.telemetry import process as telemetry_lib
from tunix_stage_plugin.core.telemetry import record as record_lib
from tunix_stage_plugin.lab import rss
from tunix_stage_plugin.lab.bench import cpu
from tunix_stage_plugin.lab.bench import host as host_lib
from tunix_stage_plugin.lab.bench import metrics
from tunix_stage_plugin.lab.bench import modes as modes_lib
from tunix_stage_plugin.lab.bench import results
from tunix_stage_plugin.lab.embedded import client as client_lib
from tunix_stage_plugin.lab.embedded import data as data_lib
from tunix_stage_plugin.lab.embedded import job as job_lib
from tunix_stage_plugin.lab.embedded import process as process_lib

BURSTY_HEAD, BURSTY_HEAD_SLOWDOWN = 1 / 3, 1.6  # the first third of a step's transfers
BURSTY_SPIKE_P, BURSTY_SPIKE_SLOWDOWN = 0.2, 2.0  # and a fifth of all, at random


def plan_for(mode: str, steps: int, microbatches: int, sync_s: float,
             budget_bytes: int | None = None) -> job_lib.JobPlan:
  kinds = {m.name: m.plan for m in modes_lib.MODE_TABLE}
  if mode not in kinds:
    raise ValueError(f"unknown mode {mode!r}; accepted: {', '.join(modes_lib.MODES)}")
  budget = {} if budget_bytes is None else {"budget_bytes": budget_bytes}
  return job_lib.JobPlan(steps, microbatches, sync_s=sync_s, **kinds[mode], **budget)


def transfer_slowdown(scenario: str, seed: int, microbatches: int
                      ) -> Callable[[data_lib.Batch], float] | None:
  """How much slower each micro-batch's wire transfer is than the calibrated link (None: never).

  bursty: seeded; the first third of each step's micro-batches 1.6x (the front-loaded contention
  of the upstream change's measured step) and, independently, a fifth of all 2x (spikes). The
  same micro-batch is as slow in every mode, whichever call carries it (a stage or an inline
  train), so the modes still compare like for like.
  """
  if scenario == "steady":
    return None

  def slowdown(batch: data_lib.Batch) -> float:
    factor = BURSTY_HEAD_SLOWDOWN if batch.index < BURSTY_HEAD * microbatches else 1.0
    spike = np.random.default_rng([seed, 7919, batch.step, batch.index]).random()
    return factor * (BURSTY_SPIKE_SLOWDOWN if spike < BURSTY_SPIKE_P else 1.0)

  return slowdown


def sized_host(options: results.BenchOptions, mode: str) -> bool:
  """Whether `mode`'s run sizes the trainer's host bound (the auto mode, at the setting's auto)."""
  return options.size_host_bound and bool(modes_lib.BY_NAME[mode].plan.get("auto"))


def receive_buffers(options: results.BenchOptions, mode: str) -> int:
  """The receive buffers a mode's steady state reuses (measured): inline the one arriving (the
  pool gets the last one back from JAX, transport/listener.py); staged also the device and host bounds'
  batches; resident none."""
  kind = modes_lib.BY_NAME[mode].plan["kind"]
  if kind == "resident":
    return 0
  return 1 + (options.max_device_batches + options.max_host_batches if kind == "staged" else 0)


class BenchHost:
  """host.BenchHost on the embedded host."""

  def __init__(self, options: results.BenchOptions) -> None:
    self.options = options
    self.trainer: process_lib.TrainerProcess | None = None
    self.client: client_lib.WorkerClient | None = None
    self.engine: client_lib.EmbeddedEngine | None = None

  @property
  def pids(self) -> tuple[int, ...]:
    return () if self.trainer is None else (self.trainer.pid,)

  def start(self, say: host_lib.Say) -> None:
    say("starting the trainer process (JAX, 2-device CPU mesh, gRPC on 127.0.0.1)")
    # '' lets JAX choose: an accelerator when there is one (--h2d auto and real).
    self.trainer = process_lib.TrainerProcess(
        max_device_batches=self.options.max_device_batches,
        max_host_batches=(config_lib.AUTO if self.options.size_host_bound
                          else self.options.max_host_batches),
        extra_args=["--stage_log_every", str(self.options.log_every)],
        jax_platforms="cpu" if self.options.h2d == "emulated" else "")

  def stop(self) -> int | None:
    if self.trainer is None:
      return None
    self.trainer.stop()  # idempotent
    return self.trainer.proc.returncode

  async def open(self) -> None:
    assert self.trainer is not None
    self.client = client_lib.WorkerClient(self.trainer.address)
    await self.client.wait_ready()
    self.engine = client_lib.EmbeddedEngine(self.client, transfer_slowdown=transfer_slowdown(
        self.options.scenario, self.options.seed, self.options.microbatches))

  async def close(self) -> None:
    client, self.client = self.client, None
    if client is not None:
      await client.close()

  async def calibrate(self, sizes: data_lib.Sizes) -> results.Calibration:
    """Compiles (one resident step), then measures compute and its memory on resident data over
    the other steps (a fresh setup in between: compiled functions are kept, the peak restarts),
    and the other processes' cores meanwhile."""
    assert self.client is not None and self.engine is not None and self.trainer is not None
    offset, uncertainty = await self.client.clock_offset()
    load = cpu.ForeignLoad([os.getpid(), self.trainer.pid])
    for steps in (1, results.CALIBRATION_STEPS - 1):
      await self.client.call("setup", sizes=sizes.as_dict(), seed=self.options.seed,
                             max_host_batches=self.options.max_host_batches)
      plan = job_lib.JobPlan(steps, self.options.microbatches, kind="resident")
      load.start()
      await job_lib.run_job(self.engine, plan, lambda s, i: data_lib.Batch(s, i, {}))
    foreign = load.lap()  # over the measured steps only
    memory = (await self.client.call("finish"))["rss"]
    spans = await self.client.call("timeline")
    compute, update = metrics.calibrated(spans, range(results.CALIBRATION_STEPS - 1))
    payload = sizes.payload_bytes
    info = await self.client.call("info")
    real = self.options.h2d == "real" or (self.options.h2d == "auto" and info["platform"] != "cpu")
    return results.Calibration(
        compute_s=compute, update_s=update, payload_bytes=payload,
        wire_bytes_per_s=payload / (self.options.wire_ratio * compute),
        h2d_bytes_per_s=None if real else payload / (self.options.h2d_ratio * compute),
        h2d="real" if real else "emulated", platform=info["platform"],
        devices=tuple(info["devices"]),
        sync_s=self.options.sync_ratio * compute, clock_offset_s=offset,
        clock_uncertainty_s=uncertainty, foreign_cores=foreign,
        compute_memory_bytes=metrics.compute_memory(memory, self.options.microbatches * payload))

  async def run_mode(self, calibration: results.Calibration, mode: str, round_: int,
                       make: data_lib.BatchMaker) -> results.ModeRun:
    assert self.client is not None and self.engine is not None and self.trainer is not None
    self.client.pacer.set_rate(calibration.wire_bytes_per_s)
    await self.client.call("setup", sizes=self.options.sizes().as_dict(), seed=self.options.seed,
                      h2d_mbps=(None if calibration.h2d_bytes_per_s is None
                                else calibration.h2d_bytes_per_s / 1e6),
                      receive_buffers=receive_buffers(self.options, mode),
                      max_host_batches=None if sized_host(self.options, mode)
                      else self.options.max_host_batches)
    plan = plan_for(mode, self.options.total_steps, self.options.microbatches, calibration.sync_s,
                    self.options.memory_budget)
    # An auto run says its choices as a job does: the orchestrator's line each step.
    telemetry = (telemetry_lib.Telemetry(telemetry_lib.Settings("embedded",
                                                                log_every=self.options.log_every))
                 if plan.auto else None)
    recorder = trace_lib.Kept()
    load = cpu.ForeignLoad([os.getpid(), self.trainer.pid])
    step_loads: list[float | None] = []
    if mode == "resident":  # the trainer built these itself; only their ids travel
      batch_for: Callable[[int, int], data_lib.Batch] = lambda s, i: data_lib.Batch(s, i, {})
    else:
      batch_for = make
    self.engine.wire = client_lib.WireStats()
    self.engine.codec = self.options.codec_for(mode)
    gc.collect()  # the previous run's garbage is not this run's memory
    orchestrator_baseline = rss.reset_peak()
    origin = time.perf_counter()
    load.start()
    outcomes = await job_lib.run_job(self.engine, plan, batch_for, timeline=recorder,
                                     telemetry=telemetry,
                                     on_step=lambda _: step_loads.append(load.lap()))
    finish = await self.client.call("finish")
    trainer_spans = await self.client.call("timeline")
    records = await self.client.call("records")
    timings = metrics.step_timings(trainer_spans, range(results.WARMUP_STEPS, self.options.total_steps))
    spans = recorder.spans() + trace_lib.shifted(trainer_spans, calibration.clock_offset_s)
    fwd_bwd = [metrics.fwd_bwd_durations(trainer_spans, t.step) for t in timings]
    return results.ModeRun(
        mode=mode, round=round_, timings=timings, fwd_bwd_s=fwd_bwd,
        update_s=[metrics.update_duration(trainer_spans, t.step) for t in timings],
        stage_call_s=[s.duration for s in recorder.spans(tracks.ORCHESTRATOR_STAGE)],
        fallbacks=sum(o.report.fallbacks for o in outcomes),
        fallback_reasons=[r for o in outcomes for r in o.report.fallback_reasons],
        peak_device_batches=finish["store"]["peak"],
        max_device_batches=finish["max_device_batches"],
        peak_host_batches=finish["store"]["peak_host"],
        trained_order=finish["trained_order"], param_digest=finish["param_digest"],
        step_foreign_cores=step_loads[results.WARMUP_STEPS:], spans=spans, origin=origin,
        wire=self.engine.wire.as_dict(), trainer_rss=finish["rss"],
        orchestrator_rss={"baseline": orchestrator_baseline, "peak": rss.peak()},
        host_path=metrics.host_path(trainer_spans, since=metrics.warmed_up(trainer_spans, results.WARMUP_STEPS)),
        device_memory=finish["device_memory"],
        h2d_s=metrics.median([s.duration for s in trainer_spans if s.track == tracks.TRAINER_H2D
                              and dict(s.args)["step"] >= results.WARMUP_STEPS]),
        h2d_overlap=metrics.placement_overlap(trainer_spans, since=metrics.warmed_up(trainer_spans, results.WARMUP_STEPS)),
        job_side=records[results.WARMUP_STEPS:] if records else None,
        choices=[] if telemetry is None else metrics.choices(
            telemetry.history[record_lib.ORCHESTRATOR], records))
