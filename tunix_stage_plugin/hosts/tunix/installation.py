"""The state of one tunix installation, kept outside tunix's objects and closed with it: the
trainer's staged batches, method lanes, side channels, chunked streams and receive buffers; the
orchestrator's routers. A re-install with new depths applies them to live workers; uninstall
closes every lane, listener and side channel, drops every staged batch and gives back the idle
receive buffers (docs/design.md "Layout").
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import weakref
from typing import Any, Callable

from tunix_stage_plugin.core import buffers as buffers_lib
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import store as store_lib
from tunix_stage_plugin.core.telemetry import process as telemetry_lib
from tunix_stage_plugin.core.telemetry import record as record_lib
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib
from tunix_stage_plugin.core.telemetry import trainer as trainer_telemetry
from tunix_stage_plugin.hosts.tunix import lanes as lanes_lib
from tunix_stage_plugin.hosts.tunix import sessions as sessions_lib
from tunix_stage_plugin.transport import frames
from tunix_stage_plugin.transport import listener as listener_lib

# How long uninstall waits for a lane's running call before leaving its daemon thread behind.
CLOSE_TIMEOUT_S = 10.0
# The most one chunked or side-channel call may announce; a header announcing more is refused
# before any of its bytes is read. Far above a production micro-batch (5 GB), far below what a
# corrupt header could claim.
MAX_STREAM_BYTES = 64 << 30
HOST = "tunix"  # the host the records name (a trainer's own kind, e.g. maxtext, where it has one)


class WorkerStaging:
  """One TrainerWorker's staging state."""

  def __init__(self, config: config_lib.StageConfig, host_bound: int) -> None:
    self.store = store_lib.StagedBatchStore(config.max_device_batches,
                                            max_host_batches=host_bound)
    self.placement: Any = None  # how this worker's trainer stages (hosts.placements.Placement)
    self.target: Any = None  # the object whose preparation seam stages
    self.unsupported: str | None = None  # why this worker's trainer can never stage
    self.sessions = sessions_lib.Sessions()  # a new orchestrator drops its predecessors' batches


@dataclasses.dataclass
class SideChannel:
  """One server's bulk side channel (side.py): its listener and the transfers its calls
  announced."""

  listener: listener_lib.BulkListener
  transfers: listener_lib.Transfers


class Installation:

  def __init__(self, live: config_lib.LiveConfig) -> None:
    self.live = live
    self._lock = threading.Lock()
    self._workers: "weakref.WeakKeyDictionary[Any, WorkerStaging]" = weakref.WeakKeyDictionary()
    # Trainer side. The lanes every received call is handed to (set by server.apply, with
    # tunix's own dispatch); where large calls are received (buffers reused once nothing
    # references them); the servers serving the chunked stream and each server's side channel
    # (whether servers started from now on get one, the bounds its listener holds a peer to);
    # the calls each carried, per method.
    self.lanes: lanes_lib.Lanes | None = None
    self.pool = buffers_lib.HostBufferPool()
    self.max_stream_bytes = MAX_STREAM_BYTES
    self.streaming_servers: "weakref.WeakSet[Any]" = weakref.WeakSet()
    self.chunked_calls: collections.Counter[str] = collections.Counter()
    self.side_channels: "weakref.WeakKeyDictionary[Any, SideChannel]" = (
        weakref.WeakKeyDictionary())
    self.serve_side_channel = True
    self.bulk_limits = frames.BulkLimits()
    self.bulk_calls: collections.Counter[str] = collections.Counter()
    # Orchestrator side: each engine's router (route.Router; made there, since it needs tunix).
    self.routers: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
    self._said: set[str] = set()  # the once-per-installation log lines already said
    # Both sides: what staging does in this process, step by step (core.telemetry): every span
    # the staging path records (the receive pool's waits included), the watcher of each
    # computation (made on the first), tunix's PerfTracers told of the staging spans.
    self.telemetry = telemetry_lib.Telemetry(telemetry_lib.Settings.of(HOST, live.config))
    self.pool.recorder = self.telemetry.recorder
    # A trainer's step figures listen from the start (its first stages arrive before its first
    # computation); in a process that only orchestrates they see no span of theirs.
    self.telemetry.trainer(self._take_peaks)
    self._watcher: trainer_telemetry.ComputeWatcher | None = None
    self._tracers: list[Any] = []
    self._logger: Any = None  # the metrics logger told of each trainer step (the first met)
    # The host bound in force: the setting's, or at auto the trainer's own choice each step
    # (core.sizing.HostBound, loaded only then).
    self.host_bound: Any = None
    self._host = self._host_bound_of(live.config)
    self._bound_pool()
    live.on_update(self._reconfigure)

  @property
  def recorder(self) -> recorder_lib.Recorder:
    return self.telemetry.recorder

  def watcher(self, wait: Callable[[Any], None], host: str) -> trainer_telemetry.ComputeWatcher:
    """The computations' watcher (`wait` blocks until an output is ready), made with this
    process's trainer-side step figures on the first computation of a `host` trainer."""
    with self._lock:
      if self._watcher is None:
        self.telemetry.trainer(host=host)
        self._watcher = trainer_telemetry.ComputeWatcher(self.telemetry.recorder, wait)
      return self._watcher

  def drain(self, timeout: float | None = None) -> bool:
    """Waits until every computation dispatched so far is recorded (a bench between its runs)."""
    with self._lock:
      watcher = self._watcher
    return watcher is None or watcher.drain(timeout)

  def trace_into(self, tracer: Any, make_sink: Callable[[Any], recorder_lib.Sink]) -> None:
    """Tells `tracer` (a trainer's tunix PerfTracer) of the staging spans from now on (once)."""
    with self._lock:
      if any(t is tracer for t in self._tracers):
        return
      self._tracers.append(tracer)
    self.telemetry.recorder.add_sink(make_sink(tracer))

  def log_into(self, logger: Any, make_sink: Callable[[], telemetry_lib.StepSink]) -> None:
    """Tells `logger` (a trainer's own metrics logger) each trainer step's figures from now on,
    where no logger is told yet: the figures are this process's, and a logger's backends listen
    process-wide (jax.monitoring), so one logger gets them to every backend once."""
    with self._lock:
      if self._logger is not None:
        return
      self._logger = logger
    self.telemetry.add_step_sink(make_sink())

  def _take_peaks(self) -> tuple[int, int]:
    """The most staged micro-batches held at once, over this node's workers, since last asked."""
    with self._lock:
      states = list(self._workers.values())
    peaks = [state.store.take_peaks() for state in states]
    return (sum(p[0] for p in peaks), sum(p[1] for p in peaks))

  def first_time(self, what: str) -> bool:
    """True the first time `what` is asked about in this installation (a line said once)."""
    with self._lock:
      if what in self._said:
        return False
      self._said.add(what)
      return True

  def staging_of(self, worker: Any) -> WorkerStaging:
    with self._lock:
      state = self._workers.get(worker)
      if state is not None:
        return state
      state = self._workers[worker] = WorkerStaging(self.live.config, self._host)
    self._bound_pool()  # one more worker: room for its staged batches too
    return state

  def drop_staged(self, worker: Any) -> None:
    """Drops `worker`'s staged batches (its server stopped), waking any placement waiting for a
    slot they held."""
    with self._lock:
      state = self._workers.get(worker)
    if state is not None:
      state.store.reset()

  def router_of(self, engine: Any, make: Callable[[], Any]) -> Any:
    """`engine`'s router, made by `make` on first use."""
    with self._lock:
      router = self.routers.get(engine)
      if router is None:
        router = self.routers[engine] = make()
      return router

  def _bound_pool(self) -> None:
    """The receive buffers in use at once: at most the micro-batches this node's workers may hold
    staged (their device and host bounds), counting those whose computation has not ended."""
    config = self.live.config
    with self._lock:
      workers = max(1, len(self._workers))
    self.pool.set_bound(workers * (config.max_device_batches + self._host))

  def _host_bound_of(self, config: config_lib.StageConfig) -> int:
    """The host bound `config` puts in force; at auto, a sizer of it (a trainer step sink, made
    once) and the bound it holds (1 to start with)."""
    if not config_lib.is_auto(config.max_host_batches):
      return config.max_host_batches
    if self.host_bound is None:
      from tunix_stage_plugin.core import sizing  # pylint: disable=import-outside-toplevel
      self.host_bound = sizing.HostBound(budget_bytes=config.memory_budget,
                                         device_bound=config.max_device_batches,
                                         apply=self._apply_host_bound)
      self.telemetry.add_step_sink(self.host_bound, record_lib.TRAINER)
    self.host_bound.budget_bytes = config.memory_budget
    self.host_bound.device_bound = config.max_device_batches
    self.telemetry.sized(record_lib.TRAINER, "max_host_batches",
                         self.host_bound.bound, self.host_bound.reason)
    return self.host_bound.bound

  def _apply_host_bound(self, bound: int, reason: str) -> None:
    """The host bound sized at auto: for later arrivals (what is held stays held)."""
    config = self.live.config
    if not config_lib.is_auto(config.max_host_batches):
      return  # a re-install fixed it since
    self.telemetry.sized(record_lib.TRAINER, "max_host_batches", bound, reason)
    self._set_bounds(config, bound)

  def _set_bounds(self, config: config_lib.StageConfig, host: int) -> None:
    with self._lock:
      self._host = host
      states = list(self._workers.values())
    for state in states:
      state.store.set_bounds(config.max_device_batches, host)
    self._bound_pool()

  def _reconfigure(self, config: config_lib.StageConfig) -> None:
    self.telemetry.configure(telemetry_lib.Settings.of(HOST, config))
    self._set_bounds(config, self._host_bound_of(config))

  def close(self) -> None:
    """Drops every staged batch, closes every lane (bounded), listener and side channel and gives
    back the idle receive buffers; the hooks are going away."""
    with self._lock:
      states, self._workers = list(self._workers.values()), weakref.WeakKeyDictionary()
      sides, self.side_channels = list(self.side_channels.values()), weakref.WeakKeyDictionary()
      routers, self.routers = list(self.routers.values()), weakref.WeakKeyDictionary()
    for side in sides:
      side.listener.close()
    for router in routers:
      router.close_sides()  # sockets; the grpc.aio channels close with their event loop
    for state in states:
      state.store.reset()
    if self.lanes is not None:
      self.lanes.close(CLOSE_TIMEOUT_S)
    if self._watcher is not None:
      self._watcher.close()
    self.telemetry.close()
    self.pool.trim()
