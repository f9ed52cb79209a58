"""The trainer's one door: every call a trainer's server received, whatever carried it (tunix's
unary call, the side channel, the chunked stream), is handed to the worker's method lanes here,
once, with a `Receipt` saying how it came; a bulk call (either carrier) is decoded and answered
here too (`Lanes.answer`, the one receive side), its failures in tunix's envelope.

Why: tunix runs a sync worker method on the server's event loop, so a stage would wait behind a
running fwd_bwd. A server bound to a TrainerWorker gets core.executor's lanes; one bound to anything
else runs tunix's own dispatch. The job's telemetry sees each call here (its receive, and the
compute lane's own calls). docs/design.md "A micro-batch's way", docs/observability.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import threading
import traceback
import weakref
from typing import Any, Awaitable, Callable

from tunix_stage_plugin.core import executor as executor_lib
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib
from tunix_stage_plugin.hosts.tunix import contract
from tunix_stage_plugin.transport import frames
from tunix_stage_plugin.transport import request as request_lib

# A TrainerWorker's lane table (core.executor): stage_batch on the staging thread; heartbeat, info
# and reset_staged answered at once (a reset only drops references, and must not queue behind a
# stage waiting for a device slot: the reset is often what frees that slot); any other method on
# the compute thread.
STAGING_METHODS = frozenset({contract.STAGE_BATCH})
LIGHT_METHODS = frozenset({contract.HEARTBEAT, contract.INFO, contract.RESET_STAGED})
# The compute-lane calls the worker's hooks observe as computations (worker.py); every other call
# on that lane is the lane's own (tracks.TRAINER_LANE).
COMPUTATIONS = frozenset({contract.FWD_BWD, contract.UPDATE})
# Where the trainer's cap on one bulk call (Installation.max_stream_bytes) is set, for the line
# that refuses a header over it.
CAP_SETTING = "tunix_stage_plugin.hosts.tunix.installation.MAX_STREAM_BYTES"


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
               trainer_worker_cls: type, recorder: recorder_lib.Recorder,
               request_cls: type, response_cls: type) -> None:
    self._host_execute = host_execute  # tunix's own RemoteExecutionServer.execute_request
    self._trainer_worker_cls = trainer_worker_cls
    # tunix's ExecutionRequest and ExecutionResponse (this module imports no tunix)
    self._request_cls, self._response_cls = request_cls, response_cls
    self._recorder = recorder
    self._lock = threading.Lock()
    self._executors: "weakref.WeakKeyDictionary[Any, executor_lib.MethodExecutor]" = (
        weakref.WeakKeyDictionary())

  async def dispatch(self, server: Any, request: Any, receipt: Receipt) -> Any:
    """`request` run for `server` as its method's lane says; tunix's ExecutionResponse."""
    if receipt.started is not None:  # how it came changes nothing of where it runs
      self._recorder.add(tracks.TRAINER_RECEIVE, receipt.method, receipt.started, receipt.ended,
                         transport=receipt.transport, bytes=receipt.nbytes)
    instance = server.bound_instance
    # The real type, not isinstance: tests bind spec'd mocks that claim to be TrainerWorkers.
    if not issubclass(type(instance), self._trainer_worker_cls):
      return await self._host_execute(server, request)
    name = request.method_name or "__call__"
    if inspect.iscoroutinefunction(getattr(instance, name, None)):
      return await self._host_execute(server, request)  # async methods leave the loop on await
    # execute_sync_request is tunix's own resolve-call-and-wrap-errors step.
    executor = self.executor_for(server)
    run = server.execute_sync_request
    if executor.lane_of(name) is executor_lib.Lane.COMPUTE and name not in COMPUTATIONS:
      run = functools.partial(self._lane_call, name, run)
    return await executor.run(name, run, request)

  async def answer(self, server: Any, transport: str,
                   receive: Callable[[], Awaitable[tuple[frames.Header, frames.Received]]],
                   request_id: str | None = None) -> Any:
    """A bulk call (`receive()`: its header and its parts' buffers, as `transport` carried them)
    decoded over its buffers and dispatched with its receipt; tunix's ExecutionResponse, any
    failure in its envelope, as tunix's own handler answers one (`request_id`: the carrying
    call's)."""
    try:
      header, received = await receive()
      receipt = Receipt(transport, header.method, header.announced, received.started,
                        received.ended)
      buffers = received.buffers
      del received
      if header.body is None:  # a large pickle: unpickled off the event loop
        call = await asyncio.to_thread(request_lib.decode_received, header, buffers)
      else:
        call = request_lib.decode_received(header, buffers)
      del buffers  # the arrays over them are all that is kept
      request = self._request_cls(request_id=call[0], method_name=call[1], args=call[2],
                                  kwargs=call[3])
      del call
      return await self.dispatch(server, request, receipt)
    except Exception as e:  # pylint: disable=broad-except  (travels back, as tunix's handler does)
      return self._response_cls(error_message=str(e), error_type=type(e).__name__,
                                traceback=traceback.format_exc(), request_id=request_id)

  def _lane_call(self, name: str, run: Callable[[Any], Any], request: Any) -> Any:
    """A compute-lane call of the lane's own, timed on the lane."""
    with self._recorder.span(tracks.TRAINER_LANE, name, method=name):
      return run(request)

  def executor_for(self, server: Any) -> executor_lib.MethodExecutor:
    """The server's executor, started on its first routed request (threads start lazily)."""
    with self._lock:
      executor = self._executors.get(server)
      if executor is None:
        executor = self._executors[server] = executor_lib.MethodExecutor(
            staging_methods=STAGING_METHODS, light_methods=LIGHT_METHODS, name="trainer")
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
