"""Method executor for a served worker: which thread runs which remote method.

Today's host runs every sync worker method inline on the RPC server's only event loop, so a stage
request waits behind a running fwd_bwd and a heartbeat waits behind both. This executor gives a
served object three lanes:

- compute: one thread, FIFO. fwd_bwd, update, weight-sync prepare/release, checkpoint, eval,
  compile, and any method not named below run here in arrival order, so trainer state is still
  touched by one thread in the order requests arrived (as on the single loop thread today).
- staging: one thread. stage_batch runs here, overlapping a running fwd_bwd.
- inline: heartbeat / info / reset_staged are answered on the caller's thread at once.
  reset_staged only drops references, and it must not queue behind a stage that is waiting
  (bounded) for a device slot: the reset is often what frees that slot.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import functools
import threading
from typing import Any, Callable, Iterable


class Lane(enum.Enum):
  COMPUTE = "compute"
  STAGING = "staging"
  INLINE = "inline"


STAGING_METHODS = frozenset({"stage_batch"})
LIGHT_METHODS = frozenset({"heartbeat", "info", "reset_staged"})


class ExecutorClosedError(RuntimeError):
  pass


class MethodExecutor:
  """Routes method calls to the compute, staging or inline lane."""

  def __init__(
      self,
      *,
      staging_methods: Iterable[str] = STAGING_METHODS,
      light_methods: Iterable[str] = LIGHT_METHODS,
      name: str = "trainer",
  ) -> None:
    self.staging_methods = frozenset(staging_methods)
    self.light_methods = frozenset(light_methods)
    overlap = self.staging_methods & self.light_methods
    if overlap:
      raise ValueError(f"methods {sorted(overlap)} are both staging and light; pick one lane")
    self._name = name
    self._lock = threading.Lock()
    self._pools: dict[Lane, concurrent.futures.ThreadPoolExecutor] = {}
    self._closed = False

  def lane_of(self, method_name: str) -> Lane:
    if method_name in self.light_methods:
      return Lane.INLINE
    if method_name in self.staging_methods:
      return Lane.STAGING
    return Lane.COMPUTE

  def _pool(self, lane: Lane) -> concurrent.futures.ThreadPoolExecutor:
    # Threads start lazily: a worker that never stages never starts a staging thread.
    with self._lock:
      if self._closed:
        raise ExecutorClosedError(f"{self._name} method executor is closed")
      pool = self._pools.get(lane)
      if pool is None:
        pool = self._pools[lane] = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"{self._name}-{lane.value}"
        )
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
    return await loop.run_in_executor(self._pool(lane), functools.partial(fn, *args, **kwargs))

  def close(self) -> None:
    """Waits for queued work, joins every thread this executor started. Idempotent."""
    with self._lock:
      self._closed = True
      pools, self._pools = list(self._pools.values()), {}
    for pool in pools:
      pool.shutdown(wait=True)

  def __enter__(self) -> "MethodExecutor":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()
