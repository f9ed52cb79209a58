"""Which thread runs which remote method of a served worker.

A host runs every sync worker method on its server's one event loop, so a stage would wait behind
a running fwd_bwd. Three lanes, by the host's lane table (tunix's: core/contract.py): compute, one
FIFO thread for every method the table does not name; staging, one thread for the staging
methods; inline, the light methods, on the caller's thread. Lane threads are daemons, so a
process that gives up on a stuck lane can exit: docs/embedded.md "Stopping the trainer".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import functools
import queue
import threading
import time
from typing import Any, Callable, Iterable

from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib


class Lane(enum.Enum):
  COMPUTE = "compute"
  STAGING = "staging"
  INLINE = "inline"


class ExecutorClosedError(RuntimeError):
  pass


class _LaneThread(concurrent.futures.Executor):
  """One daemon thread running its calls in arrival order (a 1-thread pool that can be abandoned).

  concurrent.futures.ThreadPoolExecutor joins its threads at interpreter exit, so one call stuck
  in a 60 s weight sync would hold a stopping process for its whole length.
  """

  def __init__(self, name: str) -> None:
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._shut = False
    self._pending = 0  # calls queued or running
    self._thread = threading.Thread(target=self._work, name=name, daemon=True)

  def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
             ) -> concurrent.futures.Future:
    with self._lock:
      if self._shut:
        raise ExecutorClosedError(f"lane {self._thread.name} is shut down")
      future: concurrent.futures.Future = concurrent.futures.Future()
      self._queue.put((future, fn, args, kwargs))
      self._pending += 1
      if self._thread.ident is None:
        # Started with its first call queued, as ThreadPoolExecutor does: the new thread takes
        # that call at once (the pipeline's tests rely on that interleaving).
        self._thread.start()
      return future

  @property
  def shut(self) -> bool:
    return self._shut

  def _work(self) -> None:
    while True:
      item = self._queue.get()
      if item is None:
        return
      future, fn, args, kwargs = item
      del item
      if future.set_running_or_notify_cancel():
        try:
          result = fn(*args, **kwargs)
        except BaseException as e:  # pylint: disable=broad-except  (delivered through the future)
          future.set_exception(e)
        else:
          future.set_result(result)
      del future, fn, args, kwargs  # drop the call's arguments before waiting for the next one
      with self._lock:
        self._pending -= 1

  def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
    """Stops after the queued calls; `wait` joins the thread (never from the thread itself)."""
    with self._lock:
      if not self._shut:
        self._shut = True
        self._queue.put(None)
    if wait and self._thread.ident is not None:
      self.join(None)

  def is_current(self) -> bool:
    return threading.current_thread() is self._thread

  def join(self, timeout: float | None) -> bool:
    """True once the thread has finished; the calling lane's own thread counts as finished."""
    if self.is_current() or self._thread.ident is None:
      return True
    self._thread.join(timeout)
    if self._thread.is_alive():
      with self._lock:
        idle = self._pending == 0
      if idle:  # only the stop marker is left: the thread is leaving, not busy
        self._thread.join()
    return not self._thread.is_alive()


class MethodExecutor:
  """Routes method calls to the compute, staging or inline lane: `staging_methods` and
  `light_methods` are the host's lane table; any other method runs on the compute lane. With a
  `recorder`, a compute-lane call of a method not in `observed` (the host times those itself) is
  recorded as the lane's own call (tracks.TRAINER_LANE), on the lane."""

  def __init__(self, *, staging_methods: Iterable[str] = (), light_methods: Iterable[str] = (),
               name: str = "trainer", recorder: recorder_lib.Recorder | None = None,
               observed: Iterable[str] = ()) -> None:
    self.staging_methods = frozenset(staging_methods)
    self.light_methods = frozenset(light_methods)
    self._recorder = recorder
    self._observed = frozenset(observed)
    overlap = self.staging_methods & self.light_methods
    if overlap:
      raise ValueError(f"methods {sorted(overlap)} are both staging and light; pick one lane")
    self._name = name
    self._lock = threading.Lock()
    self._pools: dict[Lane, _LaneThread] = {}
    self._closed = False

  def lane_of(self, method_name: str) -> Lane:
    if method_name in self.light_methods:
      return Lane.INLINE
    if method_name in self.staging_methods:
      return Lane.STAGING
    return Lane.COMPUTE

  def _pool(self, lane: Lane) -> _LaneThread:
    # Threads start lazily: a worker that never stages never starts a staging thread.
    with self._lock:
      if self._closed:
        raise ExecutorClosedError(f"{self._name} method executor is closed")
      pool = self._pools.get(lane)
      if pool is None:
        pool = self._pools[lane] = _LaneThread(f"{self._name}-{lane.value}_0")
      return pool

  def submit(self, method_name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any
             ) -> concurrent.futures.Future:
    """Runs `fn` on `method_name`'s lane; inline calls complete before this returns."""
    lane = self.lane_of(method_name)
    if lane is Lane.INLINE:
      if self._closed:
        raise ExecutorClosedError(f"{self._name} method executor is closed")
      future: concurrent.futures.Future = concurrent.futures.Future()
      try:
        future.set_result(fn(*args, **kwargs))
      except BaseException as e:  # pylint: disable=broad-except  (delivered through the future)
        future.set_exception(e)
      return future
    return self._pool(lane).submit(fn, *args, **kwargs)

  async def run(self, method_name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Awaitable form for an asyncio server: the event loop never runs a lane's work."""
    lane = self.lane_of(method_name)
    if lane is Lane.INLINE:
      return self.submit(method_name, fn, *args, **kwargs).result()
    loop = asyncio.get_running_loop()
    call = functools.partial(fn, *args, **kwargs)
    if lane is Lane.COMPUTE and self._recorder is not None and method_name not in self._observed:
      call = functools.partial(self._timed, self._recorder, method_name, call)
    return await loop.run_in_executor(self._pool(lane), call)

  @staticmethod
  def _timed(recorder: recorder_lib.Recorder, method_name: str, call: Callable[[], Any]) -> Any:
    with recorder.span(tracks.TRAINER_LANE, method_name, method=method_name):
      return call()

  def close(self, timeout: float | None = None) -> list[Lane]:
    """Refuses new calls, waits for queued and running work, joins the lane threads. Idempotent.

    `timeout` bounds the whole wait: the lanes whose work is still running then are returned
    (their daemon threads are abandoned and finish, or die with the process). Called from one of
    this executor's own lanes, that lane is not joined (it is the caller); it stops after the
    call that is closing. Returns [] when every lane stopped.
    """
    deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
    with self._lock:
      self._closed = True
      pools, self._pools = dict(self._pools), {}
    for pool in pools.values():
      pool.shutdown(wait=False)
    busy = []
    for lane, pool in pools.items():
      remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
      if not pool.join(remaining):
        busy.append(lane)
    return busy

  def __enter__(self) -> "MethodExecutor":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()
