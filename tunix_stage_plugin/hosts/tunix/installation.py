"""The per-object state of one tunix installation: each worker's staged batches and each server's
method executor, kept outside the host objects; the receive buffers of large calls and each
server's side channel (trainer) and each engine's streams (orchestrator). The installation owns
it: a re-install with new depths applies them to live workers, and uninstall closes every executor
and side channel, drops every staged batch and gives back the idle receive buffers
(docs/tunix.md).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import weakref
from typing import Any

from tunix_stage_plugin.core import buffers as buffers_lib
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import executor as executor_lib
from tunix_stage_plugin.core import store as store_lib
from tunix_stage_plugin.hosts.tunix import sessions as sessions_lib
from tunix_stage_plugin.transport import frames
from tunix_stage_plugin.transport import listener as listener_lib

# How long uninstall waits for a lane's running call before leaving its daemon thread behind.
CLOSE_TIMEOUT_S = 10.0
# The most one chunked call (a call over tunix's message cap, hosts/tunix/stream.py) may announce;
# a header announcing more is refused before any of its bytes is read. Far above a production
# micro-batch (5 GB), far below what a corrupt header could claim.
MAX_STREAM_BYTES = 64 << 30


class WorkerStaging:
  """One TrainerWorker's staging state."""

  def __init__(self, config: config_lib.StageConfig) -> None:
    self.store = store_lib.StagedBatchStore(config.max_device_batches,
                                            max_host_batches=config.max_host_batches)
    self.mesh: Any = None  # the trainer's mesh, found at the first stage
    self.placement: Any = None  # how this worker's trainer stages (hosts.tunix.worker.Placement)
    self.target: Any = None  # the object whose preparation seam stages
    self.unsupported: str | None = None  # why this worker's trainer can never stage
    self.sessions = sessions_lib.Sessions()  # a new orchestrator drops its predecessors' batches


@dataclasses.dataclass
class SideChannel:
  """One server's bulk side channel (hosts/tunix/side.py): its listener and the transfers its
  calls announced."""

  listener: listener_lib.BulkListener
  transfers: listener_lib.Transfers


class Installation:

  def __init__(self, live: config_lib.LiveConfig) -> None:
    self.live = live
    self._lock = threading.Lock()
    self._workers: "weakref.WeakKeyDictionary[Any, WorkerStaging]" = weakref.WeakKeyDictionary()
    self._executors: "weakref.WeakKeyDictionary[Any, executor_lib.MethodExecutor]" = (
        weakref.WeakKeyDictionary())
    # Trainer side: where chunked calls are received (buffers reused once nothing references
    # them), the servers serving the stream, and the chunked calls run per method.
    self.pool = buffers_lib.HostBufferPool()
    self.max_stream_bytes = MAX_STREAM_BYTES
    self.streaming_servers: "weakref.WeakSet[Any]" = weakref.WeakSet()
    self.chunked_calls: collections.Counter[str] = collections.Counter()
    # Each server's side channel, whether servers started from now on get one, the bounds its
    # listener holds a peer to (a header's bytes included: transport/frames.py BulkLimits), and
    # the side-channel calls run per method.
    self.side_channels: "weakref.WeakKeyDictionary[Any, SideChannel]" = (
        weakref.WeakKeyDictionary())
    self.serve_side_channel = True
    self.bulk_limits = frames.BulkLimits()
    self.bulk_calls: collections.Counter[str] = collections.Counter()
    self._said: set[str] = set()  # the once-per-installation log lines already said
    self._bound_pool()
    live.on_update(self._reconfigure)

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
      state = self._workers[worker] = WorkerStaging(self.live.config)
    self._bound_pool()  # one more worker: room for its staged batches too
    return state

  def _bound_pool(self) -> None:
    """The receive buffers in use at once: at most the micro-batches this node's workers may hold
    staged (their device and host bounds), counting those whose computation has not ended."""
    config = self.live.config
    with self._lock:
      workers = max(1, len(self._workers))
    self.pool.set_bound(workers * (config.max_device_batches + config.max_host_batches))

  def executor_for(self, server: Any) -> executor_lib.MethodExecutor:
    """The server's executor, started on its first routed request (threads start lazily)."""
    with self._lock:
      executor = self._executors.get(server)
      if executor is None:
        executor = self._executors[server] = executor_lib.MethodExecutor(name="trainer")
        # A server collected without stop_serving (tunix's in-process one has none) must not
        # leave its idle lane threads behind: they stop after the call they are running.
        weakref.finalize(server, executor.close, timeout=0)
      return executor

  def pop_executor(self, server: Any) -> executor_lib.MethodExecutor | None:
    with self._lock:
      return self._executors.pop(server, None)

  def _reconfigure(self, config: config_lib.StageConfig) -> None:
    with self._lock:
      states = list(self._workers.values())
    for state in states:
      state.store.set_bounds(config.max_device_batches, config.max_host_batches)
    self._bound_pool()

  def close(self) -> None:
    """Drops every staged batch, closes every executor (bounded) and side channel and gives back
    the idle receive buffers; the hooks are going away."""
    with self._lock:
      states, self._workers = list(self._workers.values()), weakref.WeakKeyDictionary()
      executors, self._executors = list(self._executors.values()), weakref.WeakKeyDictionary()
      sides, self.side_channels = list(self.side_channels.values()), weakref.WeakKeyDictionary()
    for side in sides:
      side.listener.close()
    for state in states:
      state.store.reset()
    for executor in executors:
      executor.close(timeout=CLOSE_TIMEOUT_S)
    self.pool.trim()


_current: Installation | None = None


def current() -> Installation:
  """The active installation (tests and doctor read its state)."""
  if _current is None:
    raise RuntimeError("the tunix staging hooks are not installed")
  return _current


def start(live: config_lib.LiveConfig) -> Installation:
  global _current
  _current = Installation(live)
  return _current


def stop(installation: Installation) -> None:
  global _current
  installation.close()
  if _current is installation:
    _current = None
