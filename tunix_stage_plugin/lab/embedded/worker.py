"""The trainer worker the server exposes: train, update, stage, and what the benchmark asks for.

Lanes (core.executor): fwd_bwd / update / weight_sync / setup / place_resident / finish on the
compute lane in arrival order; stage_batch on the staging lane, so a stage overlaps a running
fwd_bwd; heartbeat / info / timeline / memory / records / reset_staged inline. A stage's answer
carries the trainer's newest closed step in numbers (what an orchestrator at depth auto reads). A
received batch is placed by the placer thread (started with the first stage). With staging off,
stage_batch runs on the compute lane and refuses, so an inline-only trainer never starts a
staging or placer thread.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import threading
import time
from typing import Any, Iterable

import numpy as np

from tunix_stage_plugin.transport import listener as buffers_lib
from tunix_stage_plugin.core import codec as codec_lib
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import executor as executor_lib
from tunix_stage_plugin.core import contract
from tunix_stage_plugin.core import host_bound as host_bound_lib
from tunix_stage_plugin.lab import rss
from tunix_stage_plugin.core import store as store_lib
from tunix_stage_plugin.lab.bench import trace as trace_lib
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.telemetry import process as telemetry_lib
from tunix_stage_plugin.core.telemetry import record as record_lib
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib
from tunix_stage_plugin.lab.embedded import data as data_lib
from tunix_stage_plugin.lab.embedded import pacing

PLACER_CLOSE_S = 10.0  # how long close waits for a placement still running
LIGHT_METHODS = contract.LIGHT_METHODS | {"timeline", "memory", "records"}


def make_executor(cfg: config_lib.StageConfig) -> executor_lib.MethodExecutor:
  staging = contract.STAGING_METHODS if cfg.enabled else frozenset()
  return executor_lib.MethodExecutor(staging_methods=staging, light_methods=LIGHT_METHODS)


@dataclasses.dataclass(frozen=True)
class _Staged:
  step: int
  mb_id: str
  placed: Any  # device arrays


class InjectedStageFailure(RuntimeError):
  """A stage failure the test or benchmark asked for (`fail_stage`)."""


class TrainerWorker:
  """Serves one JAX trainer; `setup` (re)builds it, so one process can run many benchmark modes."""

  METHODS = frozenset({
      "heartbeat", "info", "timeline", "memory", "records", "setup", "place_resident", "fwd_bwd",
      "update",
      "weight_sync", "finish", "stage_batch", "reset_staged",
  })

  def __init__(self, cfg: config_lib.StageConfig, *,
               timeline: trace_lib.Kept | None = None,
               fail_stage: Iterable[str] = ()) -> None:
    self.cfg = cfg
    self._staging = cfg.enabled  # read once: what stage_batch answers
    self._configured_fail_stage = frozenset(fail_stage)
    # What this process records (core.telemetry): the bench's timeline and, with staging on,
    # the job's own step figures (its records and per-step line).
    self._timeline = timeline or trace_lib.Kept()
    self.telemetry = (telemetry_lib.Telemetry(telemetry_lib.Settings.of("embedded", cfg))
                      if cfg.enabled else None)
    self.recorder = (recorder_lib.Recorder() if self.telemetry is None
                     else self.telemetry.recorder)
    self.recorder.add_sink(self._timeline)
    if self.telemetry is not None:
      self.telemetry.trainer(lambda: self.store.take_peaks())
    # The host bound at auto: sized after each step (a trainer step sink), 1 to start with.
    self.host_bound: host_bound_lib.HostBound | None = None
    self._sized = False
    self.store = store_lib.StagedBatchStore(cfg.max_device_batches,
                                            max_host_batches=self._host_bound(None))
    self._placer: tuple[store_lib.StagedBatchStore, threading.Thread] | None = None
    self._placer_lock = threading.Lock()
    self.pool = buffers_lib.HostBufferPool()  # where the server receives large calls' bytes
    self._rss_baseline: int | None = None
    # Device memory since setup: at setup, and the most after any placement (None on CPU).
    self._device_baseline: int | None = None
    self._device_sampled_peak: int | None = None
    self._trainer: Any = None
    self._seed = 0
    self._h2d = pacing.SharedLink(None)  # the emulated host-to-device link, one per trainer
    self._fail_stage = self._configured_fail_stage
    self._resident: dict[str, Any] = {}
    self._trained: list[str] = []
    self._last_step = -1

  # --- inline lane ------------------------------------------------------------------------------

  def heartbeat(self) -> dict[str, Any]:
    return {"time": time.perf_counter(), "pid": os.getpid()}

  def info(self) -> dict[str, Any]:
    trainer = self._trainer  # JAX loads with the first setup; info never imports it on the loop
    return {
        "pid": os.getpid(),
        "mode": self.cfg.mode,
        "max_device_batches": self.store.max_device_batches,
        "max_host_batches": self.store.max_host_batches,
        "devices": [] if trainer is None else [str(d) for d in trainer.mesh.devices.flat],
        "platform": None if trainer is None else trainer.platform,
        "device_kind": None if trainer is None else trainer.mesh.devices.flat[0].device_kind,
        "threads": sorted(t.name for t in threading.enumerate()),
        "staged_keys": self.store.keys(),
    }

  def memory(self, reset: bool = False) -> dict[str, Any]:
    """This process's memory (lab/rss.py): resident and peak bytes, socket bytes moved,
    tracemalloc's figures when tracing; `reset` restarts the peaks. For tools/profile_host_path."""
    return {**rss.report(reset=reset), "pool_held_bytes": self.pool.held_bytes(),
            "pool_idle_bytes": self.pool.idle_bytes()}

  def timeline(self) -> list[recorder_lib.Span]:
    """The spans recorded since the last setup, on this process's perf_counter clock."""
    return self._timeline.spans()

  def records(self) -> list[dict[str, Any]]:
    """The trainer's own per-step records since the last setup (core.telemetry: what a job
    writes; the bench checks them against its own figures); [] with staging off."""
    return [] if self.telemetry is None else list(self.telemetry.history[record_lib.TRAINER])

  # --- compute lane -----------------------------------------------------------------------------

  def setup(self, *, sizes: dict[str, int], seed: int = 0, h2d_mbps: float | None = None,
            max_device_batches: int | None = None, max_host_batches: int | None = None,
            fail_stage: Iterable[str] | None = None, record_timeline: bool = True,
            receive_buffers: int = 0) -> dict:
    """Fresh parameters, optimizer state, store and records; the same seed gives the same run.

    None keeps the trainer's configuration: its bounds (TUNIX_STAGE_MAX_DEVICE_BATCHES,
    TUNIX_STAGE_MAX_HOST_BATCHES) and the
    micro-batch ids whose stage it fails on purpose (trainer_main --fail_stage_ids).
    `record_timeline=False` records no spans (a long job would otherwise grow them forever).
    `receive_buffers`: that many receive buffers of each large array of a micro-batch are made
    (and faulted) now, counted in this run's memory: a long job reaches them on its own after a
    few micro-batches (the pool reuses them), a short benchmark run starts from them.
    """
    # pylint: disable-next=import-outside-toplevel  (JAX loads with the first setup, not at import)
    from tunix_stage_plugin.lab.embedded import trainer as trainer_lib

    h2d = pacing.SharedLink(None if h2d_mbps is None else h2d_mbps * 1e6)  # checks the rate
    self.store.close()  # its placer thread ends
    bound = self.cfg.max_device_batches if max_device_batches is None else max_device_batches
    host_bound = self._host_bound(max_host_batches, bound)
    self.store = store_lib.StagedBatchStore(bound, max_host_batches=host_bound)
    self._trainer = trainer_lib.Trainer(data_lib.sizes_from_dict(sizes), seed)
    self._seed = seed
    self._h2d = h2d
    self._fail_stage = (self._configured_fail_stage if fail_stage is None
                        else frozenset(fail_stage))
    self._resident.clear()
    self._trained.clear()
    self._last_step = -1
    self._timeline.clear()
    self.recorder.remove_sink(self._timeline)
    if record_timeline:
      self.recorder.add_sink(self._timeline)
    if self.telemetry is not None:
      self.telemetry.restart()  # the job's step figures start again with this run
    # The memory this run starts from: the previous run's buffers given back, the peak restarted.
    gc.collect()  # runs JAX's deferred releases of placed buffers (transport/listener.py)
    self.pool.trim()
    self._rss_baseline = rss.reset_peak()
    for shape, dtype in self._trainer.sizes.array_layout().values():
      self.pool.reserve(int(np.prod(shape)) * np.dtype(dtype).itemsize, receive_buffers)
    self._device_baseline = self._device_sampled_peak = self._trainer.device_bytes_in_use()
    return {"max_device_batches": bound, "max_host_batches": host_bound,
            "payload_bytes": self._trainer.sizes.payload_bytes}

  def place_resident(self, ids: list[tuple[int, int]]) -> int:
    """Builds these micro-batches here and places them: the benchmark's no-transfer ceiling."""
    trainer = self._require_trainer()
    make = data_lib.BatchMaker(trainer.sizes, self._seed)  # on CPU, placements alias its arrays
    for step, index in ids:
      batch = make(step, index)
      self._resident[batch.mb_id] = _Staged(step, batch.mb_id, trainer.place(batch.arrays))
    return len(self._resident)

  def fwd_bwd(self, batch: data_lib.Batch | None = None, *, stage_key: str | None = None,
              resident: str | None = None) -> dict[str, Any]:
    """Accumulates one micro-batch's gradients: `batch` inline, or a staged / resident one."""
    trainer = self._require_trainer()
    given = [name for name, v in (("batch", batch), ("stage_key", stage_key),
                                  ("resident", resident)) if v is not None]
    if len(given) != 1:
      raise TypeError(f"fwd_bwd takes exactly one of batch, stage_key, resident; got {given}")
    fallback = None
    if stage_key is not None:
      try:
        item, source = self.store.take(stage_key), "staged"
      except store_lib.PlacementFailed as e:  # received but not placed: train its payload here
        payload = e.payload
        if isinstance(payload, data_lib.PackedBatch):
          try:
            payload = data_lib.unpack_batch(payload, self.pool)
          except codec_lib.CodecError as decode:
            raise contract.StagedPayloadUnreadable(
                f"staged micro-batch {payload.mb_id} did not decode ({decode}); "
                f"send it with its train call") from None
        item = _Staged(payload.step, payload.mb_id, self._place(payload, "inline"))
        source, fallback = "unplaced", e.reason
    elif resident is not None:
      if resident not in self._resident:
        raise KeyError(f"micro-batch {resident!r} is not resident; "
                       f"resident: {sorted(self._resident)}")
      item, source = self._resident.pop(resident), "resident"
    else:
      item = _Staged(batch.step, batch.mb_id, self._place(batch, "inline"))
      source = "inline"
    start = time.perf_counter()
    loss = trainer.fwd_bwd(item.placed)
    self.recorder.add(tracks.DEVICE_COMPUTE, item.mb_id, start, time.perf_counter(), step=item.step,
                      kind="fwd_bwd", source=source)
    self._trained.append(item.mb_id)
    self._last_step = item.step
    return {"loss": loss, "mb_id": item.mb_id, "source": source, "placement_fallback": fallback}

  def update(self) -> dict[str, Any]:
    trainer = self._require_trainer()
    start = time.perf_counter()
    count = trainer.update()
    self.recorder.add(tracks.DEVICE_COMPUTE, f"update s{self._last_step}", start, time.perf_counter(),
                      step=self._last_step, kind="update")
    return {"updates": count}

  def weight_sync(self, seconds: float) -> None:
    """The step boundary's weight sync, emulated: it holds the compute lane, not the CPU."""
    if not seconds >= 0:
      raise ValueError(f"weight_sync seconds must be >= 0; got {seconds!r}")
    start = time.perf_counter()
    time.sleep(seconds)
    self.recorder.add(tracks.DEVICE_SYNC, f"weight sync after s{self._last_step}", start,
                      time.perf_counter(), step=self._last_step)

  def finish(self) -> dict[str, Any]:
    trainer = self._require_trainer()
    return {
        "param_digest": trainer.digest(),
        "trained_order": list(self._trained),
        "updates": trainer.updates,
        "store": dataclasses.asdict(self.store.stats),
        "max_device_batches": self.store.max_device_batches,
        "max_host_batches": self.store.max_host_batches,
        # Resident bytes since setup (None where /proc cannot tell), and the receive buffers.
        "rss": {"baseline": self._rss_baseline, "peak": rss.peak()},
        "pool": {"made": self.pool.made, "reused": self.pool.reused,
                 "held_bytes": self.pool.held_bytes()},
        # Device bytes at setup, the most held after any placement since, and the allocator's
        # peak since the process started (None each on a backend that keeps no figures: CPU).
        "device_memory": {"baseline": self._device_baseline,
                          "sampled_peak": self._device_sampled_peak,
                          "allocator_peak": trainer.device_peak_bytes()},
        "platform": trainer.platform,
    }

  # --- staging lane -----------------------------------------------------------------------------

  def stage_batch(self, batch: data_lib.Batch, *, key: str) -> dict[str, Any]:
    """Receives `batch` under `key`, answered at once (a StageOutcome as a dict); the placer
    thread places it next, so the next stage's payload crosses the wire meanwhile."""
    if not self._staging:
      return contract.unsupported(
          key, "staging is off on this trainer (TUNIX_STAGE_BATCH=off)").as_dict()
    self._require_trainer()
    store = self.store
    result = store.receive(key, batch, refuse=_unstageable(batch))
    if result.staged:
      with self._placer_lock:
        if self._placer is None or self._placer[0] is not store:  # this store's first stage
          placer = threading.Thread(target=self._placing, args=(store,), daemon=True,
                                    name="embedded-placer")
          self._placer = (store, placer)
          placer.start()
    return result.carrying(self.telemetry.newest_trainer_step).as_dict()

  def _placing(self, store: store_lib.StagedBatchStore) -> None:
    """The placer thread: each received batch, in order, placed once a device slot is free."""
    for job in store.placements():
      with job:
        job.done(self._prepare(job.payload))

  def _prepare(self, batch: data_lib.Batch | data_lib.PackedBatch) -> _Staged:
    if batch.mb_id in self._fail_stage:
      raise InjectedStageFailure(f"injected stage failure for micro-batch {batch.mb_id}")
    if isinstance(batch, data_lib.PackedBatch):  # decoded here, on the placer thread
      start = time.perf_counter()
      batch, wire_bytes = data_lib.unpack_batch(batch, self.pool), batch.wire_bytes
      self.recorder.add(tracks.TRAINER_DECODE, batch.mb_id, start, time.perf_counter(),
                        step=batch.step, bytes=batch.nbytes, wire_bytes=wire_bytes)
    return _Staged(batch.step, batch.mb_id, self._place(batch, "staging"))

  def reset_staged(self, keys: list[str] | None = None) -> list[str]:
    return self.store.reset(keys)

  def close(self) -> None:
    """Drops what is staged and ends the placer thread (the process is stopping)."""
    self.store.close()
    with self._placer_lock:
      placer, self._placer = self._placer, None
    if placer is not None:
      placer[1].join(PLACER_CLOSE_S)

  # --- helpers ----------------------------------------------------------------------------------

  def _host_bound(self, given: int | None, device: int | None = None) -> int:
    """The host bound a run starts with: `given`, else the setting's; at auto 1, sized after each
    step from then on (within TUNIX_STAGE_MEMORY_BUDGET)."""
    self._sized = given is None and config_lib.is_auto(self.cfg.max_host_batches)
    if not self._sized:
      fixed = self.cfg.max_host_batches if given is None else given
      if self.telemetry is not None and self.host_bound is not None:  # this run's bound is given
        self.telemetry.sized(record_lib.TRAINER, "max_host_batches", fixed, None)
      return fixed
    device = self.cfg.max_device_batches if device is None else device
    if self.host_bound is None:
      self.host_bound = host_bound_lib.HostBound(budget_bytes=self.cfg.memory_budget,
                                         device_bound=device, apply=self._apply_host_bound)
      if self.telemetry is not None:
        self.telemetry.add_step_sink(self.host_bound)
    self.host_bound.restart(device)
    if self.telemetry is not None:
      self.telemetry.sized(record_lib.TRAINER, "max_host_batches", 1, self.host_bound.reason)
    return 1

  def _apply_host_bound(self, bound: int, reason: str) -> None:
    """A shrink lowers the bound for later arrivals only: what is held stays held."""
    if not self._sized:  # this run's bound was given
      return
    self.store.set_bounds(self.store.max_device_batches, bound)
    if self.telemetry is not None:
      self.telemetry.sized(record_lib.TRAINER, "max_host_batches", bound, reason)


  def _require_trainer(self) -> Any:
    if self._trainer is None:
      raise RuntimeError("the trainer is not set up; call setup(sizes=...) first")
    return self._trainer

  def _place(self, batch: data_lib.Batch, lane: str) -> Any:
    """Real placement (with --h2d real the only host-to-device time) plus the emulated time, on
    the calling lane's thread."""
    start = time.perf_counter()
    trainer = self._require_trainer()
    placed = trainer.place(batch.arrays)
    held = trainer.device_bytes_in_use()
    if held is not None:
      self._device_sampled_peak = max(held, self._device_sampled_peak or 0)
    if self._h2d.bytes_per_s is not None:  # an emulated link: the copy takes its time
      self._h2d.transfer(batch.nbytes, start)
    self.recorder.add(tracks.TRAINER_H2D, batch.mb_id, start, time.perf_counter(), step=batch.step,
                      lane=lane, bytes=batch.nbytes)
    return placed


def _unstageable(batch: Any) -> str | None:
  """Why `batch` can never be staged here (None: it may be), asked before any wait."""
  if not isinstance(batch, (data_lib.Batch, data_lib.PackedBatch)):
    return (f"TypeError: stage_batch takes a data.Batch or data.PackedBatch; "
            f"got {type(batch).__name__}")
  if isinstance(batch, data_lib.PackedBatch):  # refused at once when this trainer cannot decode
    try:
      codec_lib.check_decodable(batch.packed.codec)
    except Exception as e:  # pylint: disable=broad-except  (the reason travels back)
      return f"{type(e).__name__}: {e}"
  return None
