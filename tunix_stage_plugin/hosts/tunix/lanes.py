"""The trainer's one door: every call a trainer's server received, whatever carried it (tunix's
unary call, the side channel, the chunked stream), is handed to the worker's method lanes here,
once, with a `Receipt` saying how it came.

tunix runs a sync worker method on the server's event loop, so a stage request would wait behind
a running fwd_bwd and the step boundary's calls. Here a server bound to a TrainerWorker sends
trainer compute to one FIFO thread, stage_batch to the staging thread, and answers heartbeat,
info and reset_staged at once (core.executor's lanes); a server bound to anything else (rollout,
inference, the reference worker, tests' objects) runs tunix's own dispatch. docs/design.md "A
micro-batch's way".
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
import weakref
from typing import Any, Awaitable, Callable

from tunix_stage_plugin.core import executor as executor_lib


@dataclasses.dataclass(frozen=True)
class Receipt:
  """How a call reached the trainer."""

  transport: str  # contract.UNARY, SIDE_CHANNEL or STREAM
  method: str
  # Its bytes and when they arrived (perf_counter); None for tunix's unary call, which tunix's
  # own gRPC handler received and unpickled before the server's execute_request saw it.
  nbytes: int | None = None
  started: float | None = None
  ended: float | None = None


class Lanes:
  """Each server's method executor (started on its first routed call), and the one dispatch."""

  def __init__(self, host_execute: Callable[[Any, Any], Awaitable[Any]],
               trainer_worker_cls: type) -> None:
    self._host_execute = host_execute  # tunix's own RemoteExecutionServer.execute_request
    self._trainer_worker_cls = trainer_worker_cls
    self._lock = threading.Lock()
    self._executors: "weakref.WeakKeyDictionary[Any, executor_lib.MethodExecutor]" = (
        weakref.WeakKeyDictionary())

  async def dispatch(self, server: Any, request: Any, receipt: Receipt) -> Any:
    """`request` run for `server` as its method's lane says; tunix's ExecutionResponse."""
    del receipt  # how it came changes nothing of where it runs
    instance = server.bound_instance
    # The real type, not isinstance: tests bind spec'd mocks that claim to be TrainerWorkers.
    if not issubclass(type(instance), self._trainer_worker_cls):
      return await self._host_execute(server, request)
    name = request.method_name or "__call__"
    if inspect.iscoroutinefunction(getattr(instance, name, None)):
      return await self._host_execute(server, request)  # async methods leave the loop on await
    # execute_sync_request is tunix's own resolve-call-and-wrap-errors step.
    return await self.executor_for(server).run(name, server.execute_sync_request, request)

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

  def pop(self, server: Any) -> executor_lib.MethodExecutor | None:
    with self._lock:
      return self._executors.pop(server, None)

  def close(self, timeout: float) -> None:
    """Closes every executor (bounded by `timeout` each)."""
    with self._lock:
      executors, self._executors = list(self._executors.values()), weakref.WeakKeyDictionary()
    for executor in executors:
      executor.close(timeout=timeout)
