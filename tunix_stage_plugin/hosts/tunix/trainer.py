"""The trainer's side of one installation: what a process that serves tunix's workers runs.

Every call a server received enters once, at `execute`, whatever carried it (tunix's call, the
side channel or the chunked stream). A TrainerWorker's calls run on its server's lanes
(core/executor.py): on tunix's one event loop a stage would wait behind a running fwd_bwd. Each
worker's staging is a store and a placer thread (`WorkerStaging`). The hops: docs/design.md
"A micro-batch's way".
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import inspect
import logging
import threading
import time
import traceback
import weakref
from typing import TYPE_CHECKING, Any, Callable

import grpc
import jax
import numpy as np

from tunix_stage_plugin.core import codec_spec
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import executor as executor_lib
from tunix_stage_plugin.core import contract
from tunix_stage_plugin.core import store as store_lib
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.telemetry import record as record_lib
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib
from tunix_stage_plugin.hosts import placements
from tunix_stage_plugin.hosts.tunix import peft
from tunix_stage_plugin.transport import listener as listener_lib
from tunix_stage_plugin.transport import wire

if TYPE_CHECKING:  # loaded where the host bound is auto
  from tunix_stage_plugin.core import host_bound as host_bound_lib

log = logging.getLogger("tunix_stage_plugin")

CLOSE_TIMEOUT_S = 10.0  # how long uninstall waits for a lane's running call before leaving it
# Where the side channel's listener binds: every interface, as tunix's server ("[::]:port");
# "0.0.0.0" where the machine has no IPv6.
BIND_HOSTS = ("::", "0.0.0.0")
# Where the trainer's cap on one bulk call is set (Installation.max_stream_bytes, from it), for
# the line that refuses a header over it.
CAP_SETTING = "tunix_stage_plugin.hosts.tunix.installation.MAX_STREAM_BYTES"
# What a trainer may not hold (a line's words): what the telemetry reads, and what is then lost.
OUTPUT = ("computation output to watch", "its steps are not measured")
TRACER = ("PerfTracer to read", "staging's spans are not on its timelines")
LOGGER = ("metrics logger to read", "staging's figures are not logged there")


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


@dataclasses.dataclass
class SideChannel:
  """One server's bulk side channel: its listener and the transfers its calls announced."""

  listener: listener_lib.BulkListener
  transfers: listener_lib.Transfers


def nbytes(payload: Any) -> int:
  """The array bytes of a payload (a pytree)."""
  return sum(leaf.nbytes for leaf in jax.tree.leaves(payload)
             if isinstance(leaf, (np.ndarray, jax.Array)))


class WorkerStaging:
  """One TrainerWorker's staging: its store, its trainer's placement and the placer thread."""

  def __init__(self, config: config_lib.StageConfig, host_bound: int) -> None:
    self.store = store_lib.StagedBatchStore(config.max_device_batches,
                                            max_host_batches=host_bound)
    self.placement: Any = None  # how this worker's trainer stages (a hosts.interface.Placement)
    self.target: Any = None  # the object whose preparation seam stages
    self.unsupported: str | None = None  # why this worker's trainer can never stage
    self.sessions = store_lib.Sessions()  # a new orchestrator drops its predecessors' batches
    self.placer: threading.Thread | None = None  # started with the first stage


class TrainerSide:
  """The trainer's side of one installation: the lanes of each served TrainerWorker, the receive
  pool, each server's side channel, each worker's staging, the computations' watcher."""

  def __init__(self, inst: Any) -> None:  # the installation.Installation that makes it
    m = inst.modules
    self.inst = inst
    self.recorder = inst.recorder
    self._lock = threading.Lock()
    self._request_cls = m.remote_execution.ExecutionRequest
    self._response_cls = m.remote_execution.ExecutionResponse
    self._worker_cls = m.trainer_worker.TrainerWorker
    self._executors: "weakref.WeakKeyDictionary[Any, executor_lib.MethodExecutor]" = (
        weakref.WeakKeyDictionary())
    # Where large calls are received (buffers reused once nothing references them), each
    # server's side channel, the calls each carrier brought, per method.
    self.pool = listener_lib.HostBufferPool()
    self.pool.recorder = self.recorder
    self.side_channels: "weakref.WeakKeyDictionary[Any, SideChannel]" = (
        weakref.WeakKeyDictionary())
    self.streaming_servers: "weakref.WeakSet[Any]" = weakref.WeakSet()
    self.bulk_calls: collections.Counter[str] = collections.Counter()
    self.chunked_calls: collections.Counter[str] = collections.Counter()
    self._workers: "weakref.WeakKeyDictionary[Any, WorkerStaging]" = weakref.WeakKeyDictionary()
    # PeftTrainer's own preparation step becomes the seam a staged batch passes, undone with the
    # installation: set here, so a process that serves no TrainerWorker keeps tunix's untouched.
    placements.set_seam(inst.registry, m.peft_trainer.PeftTrainer, peft.SEAM)
    self._unplace_peft = peft.PeftPlacement(m.peft_trainer.PeftTrainer, inst.registry).apply()
    # A trainer's step figures listen from the start: its first stages arrive before its first
    # computation.
    inst.telemetry.trainer(self._take_peaks)
    self._watcher: recorder_lib.ComputeWatcher | None = None
    self._tracers: list[Any] = []
    self._logger: Any = None  # the metrics logger told of each trainer step (the first met)
    # The host bound in force: the setting's, or at auto the trainer's own choice each step.
    self.host_bound: host_bound_lib.HostBound | None = None
    self._config = inst.live.config
    self._host = self._host_bound_of(self._config)
    self._bound_pool()

  # ------------------------------------------------------------ every call's one door

  async def execute(self, server: Any, request: Any) -> Any:
    """A call `server` received (tunix's ExecutionRequest): the side channel's own two methods,
    or the call run as its method's lane says; tunix's ExecutionResponse."""
    if request.method_name in contract.SIDE_METHODS:
      side = self.side_channels.get(server)
      if side is not None:
        return await self._side_call(server, side, request)
    return await self._dispatch(server, request, Receipt(contract.UNARY,
                                                         request.method_name or "__call__"))

  async def _dispatch(self, server: Any, request: Any, receipt: Receipt) -> Any:
    if receipt.started is not None:  # how it came changes nothing of where it runs
      self.recorder.add(tracks.TRAINER_RECEIVE, receipt.method, receipt.started, receipt.ended,
                        transport=receipt.transport, bytes=receipt.nbytes)
    instance = server.bound_instance
    name = request.method_name or "__call__"
    # The real type, not isinstance: tests bind spec'd mocks that claim to be TrainerWorkers.
    # Async methods leave the loop on their own await.
    if (not issubclass(type(instance), self._worker_cls)
        or inspect.iscoroutinefunction(getattr(instance, name, None))):
      return await self.inst.host_execute(server, request)
    # execute_sync_request is tunix's own resolve-call-and-wrap-errors step.
    return await self._executor(server).run(name, server.execute_sync_request, request)

  async def _answer(self, server: Any, transport: str, header: wire.Header,
                    received: wire.Received, request_id: str | None) -> Any:
    """A bulk call decoded over the buffers its parts were received into, and dispatched; any
    failure in tunix's envelope, as tunix's own handler answers one."""
    try:
      receipt = Receipt(transport, header.method, header.announced, received.started,
                        received.ended)
      buffers = received.buffers
      del received
      if header.body is None:  # a large pickle: unpickled off the event loop
        call = await asyncio.to_thread(wire.decode_received, header, buffers)
      else:
        call = wire.decode_received(header, buffers)
      del buffers  # the arrays over them are all that is kept
      request = self._request_cls(request_id=call[0], method_name=call[1], args=call[2],
                                  kwargs=call[3])
      del call
      return await self._dispatch(server, request, receipt)
    except Exception as e:  # pylint: disable=broad-except  (travels back, as tunix's handler does)
      return self._error(e, request_id)

  def _error(self, error: Exception, request_id: str | None) -> Any:
    return self._response_cls(error_message=str(error), error_type=type(error).__name__,
                              traceback=traceback.format_exc(), request_id=request_id)

  def _executor(self, server: Any) -> executor_lib.MethodExecutor:
    """The server's lanes, started on its first routed call (threads start lazily)."""
    with self._lock:
      executor = self._executors.get(server)
      if executor is None:
        executor = self._executors[server] = executor_lib.MethodExecutor(
            staging_methods=contract.STAGING_METHODS, light_methods=contract.LIGHT_METHODS,
            name="trainer", recorder=self.recorder, observed=contract.OBSERVED)
        # A server collected without stop_serving (tunix's in-process one has none) must not
        # leave its idle lane threads behind: they stop after the call they are running.
        weakref.finalize(server, executor.close, timeout=0)
      return executor

  # ------------------------------------------------------------ the bulk side channel

  def listen(self, server: Any) -> None:
    """Starts `server`'s side channel listener (its receive buffers are the pool)."""
    transfers = listener_lib.Transfers(self.inst.bulk_limits)
    for host in BIND_HOSTS:
      listener = listener_lib.BulkListener(self.pool, transfers, host=host)
      try:
        listener.start()
      except OSError as e:
        log.debug("tunix-stage: the side channel cannot bind %s: %s", host, e)
        continue
      self.side_channels[server] = SideChannel(listener, transfers)
      return
    log.warning("tunix-stage: no side channel for this server (no address to bind): calls over "
                "the message cap use the chunked stream")

  def stop_listening(self, server: Any) -> None:
    side = self.side_channels.pop(server, None)
    if side is not None:
      side.listener.close()

  async def _side_call(self, server: Any, side: SideChannel, request: Any) -> Any:
    """Answers contract.SIDE_PORT (where the listener is, the bounds it holds a peer to) or
    SIDE_CALL (its header here, its bytes received by the listener, then the call)."""
    if request.method_name == contract.SIDE_PORT:
      return self._response_cls(result=wire.announcement(side.listener.port,
                                                         side.transfers.limits),
                                request_id=request.request_id)
    try:
      header = wire.decode_header(_header_bytes(request))
      try:
        wire.announced_bytes(header, self.inst.max_stream_bytes, CAP_SETTING)
      except wire.WireError:
        side.transfers.refuse(header.transfer)  # its frame is dropped at once
        raise
      # Bounded by the listener's limits (the frame begins within pair_wait_s, no pause longer
      # than stall_s); the transfer ends on every path.
      received = await side.transfers.receive(header.transfer, header.sizes)
    except Exception as e:  # pylint: disable=broad-except  (travels back, as tunix's handler does)
      return self._error(e, request.request_id)
    self.bulk_calls[header.method] += 1
    return await self._answer(server, contract.SIDE_CHANNEL, header, received,
                              request.request_id)

  # ------------------------------------------------------------ the chunked stream

  def stream_handler(self, server: Any) -> Any:
    """The chunked stream's method for `server`'s grpc server (added before tunix starts it)."""
    self.streaming_servers.add(server)
    server_ref = weakref.ref(server)  # the grpc server holds the handler; the handler not it

    async def execute_stream(request_iterator: Any, context: Any) -> bytes:
      serving = server_ref()  # held for this call only
      messages = aiter(request_iterator)
      try:
        if serving is None:
          raise RuntimeError("the server this stream belongs to is gone")
        from tunix_stage_plugin.transport import stream  # pylint: disable=import-outside-toplevel
        header = await stream.receive_header(messages, self.inst.max_stream_bytes, CAP_SETTING)
        # The header passed: the client sends the chunks now.
        await context.send_initial_metadata(((contract.STREAM_READY_KEY,
                                              contract.STREAM_READY),))
        received = await stream.receive_chunks(messages, header, self.pool)
      except Exception as e:  # pylint: disable=broad-except  (travels back in tunix's envelope)
        return self._error(e, None).serialize()
      self.chunked_calls[header.method] += 1
      return (await self._answer(serving, contract.STREAM, header, received, None)).serialize()

    return grpc.method_handlers_generic_handler(contract.STREAM_SERVICE, {
        contract.STREAM_METHOD_NAME: grpc.stream_unary_rpc_method_handler(execute_stream),
    })

  async def stopped(self, server: Any) -> None:
    """`server` stopped: its worker's staged batches can never train, so they are dropped (their
    device slots freed), then its lanes joined off the loop."""
    with self._lock:
      executor = self._executors.pop(server, None)
    if executor is not None:
      with self._lock:
        state = self._workers.get(server.bound_instance)
      if state is not None:
        state.store.reset()
      await asyncio.to_thread(executor.close)

  # ------------------------------------------------------------ a worker's staging

  def staging_of(self, worker: Any) -> WorkerStaging:
    """`worker`'s staging (made on its first stage or call)."""
    with self._lock:
      state = self._workers.get(worker)
      if state is not None:
        return state
      state = self._workers[worker] = WorkerStaging(self._config, self._host)
    self._bound_pool()  # one more worker: room for its staged batches too
    return state

  def _chosen(self, worker: Any) -> WorkerStaging:
    """`worker`'s staging, its trainer's placement chosen (once, on its first stage or call)."""
    state = self.staging_of(worker)
    if state.placement is None and state.unsupported is None:
      state.placement, state.target, state.unsupported = placements.choose(worker._trainer)  # pylint: disable=protected-access
      if state.target is not None:
        store_lib.track(state.target, state.store)
    return state

  def stage(self, worker: Any, payload: Any, key: str) -> contract.StageOutcome:
    """`payload` received under `key` (answered at once); placed next by the placer thread."""
    state = self._chosen(worker)
    if state.unsupported is not None:
      return contract.unsupported(contract.check_key(key), state.unsupported)
    state.sessions.admit(state.store, key)  # a new orchestrator: its predecessors' go
    result = state.store.receive(key, payload, refuse=_unstageable(state, payload))
    if result.staged and state.placer is None:
      with self._lock:
        if state.placer is None:
          state.placer = threading.Thread(target=self._placing, args=(state,), daemon=True,
                                          name="tunix-stage-placer")
          state.placer.start()
    return result

  def _placing(self, state: WorkerStaging) -> None:
    """The placer thread: each received batch, in order, placed once a device slot is free."""
    for job in state.store.placements():
      with job:
        job.done(self._place(state, job.payload))

  def _place(self, state: WorkerStaging, payload: Any) -> Any:
    if isinstance(payload, codec_spec.CompressedPayload):  # decoded here, off the lanes
      payload = _codec().decompress_payload(payload)
    for transform in placements.payload_transforms():
      payload = transform(payload)
    with self.recorder.span(tracks.TRAINER_H2D, "staged", lane="staging",
                            bytes=nbytes(payload)):
      return state.placement.place(state.target, payload)

  def reset(self, worker: Any, keys: list[str] | None) -> list[str]:
    """Drops staged batches (all when `keys` is None), freeing their device buffers."""
    return self.staging_of(worker).store.reset(keys)

  def fwd_bwd(self, worker: Any, original: Callable[..., Any], args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> Any:
    """The host's fwd_bwd, observed; with `stage_key=k`, on the batch staged under k, taken
    once (an unknown key raises) and handed through the trainer's preparation step."""
    state = self._chosen(worker)
    if kwargs.get(contract.STAGE_KEY) is None:  # the host's call, observed only
      payload = kwargs.get("payload", args[0] if args else None)
      return self._observed(state, contract.FWD_BWD, original, (worker, *args), kwargs, payload)
    key = kwargs.pop(contract.STAGE_KEY)
    payload = kwargs.pop("payload", args[0] if args else None)
    if payload is not None or len(args) > 1:
      raise ValueError(f"fwd_bwd got a payload and stage_key={key!r}; send one or the other")
    try:
      staged = state.store.take(key)
    except store_lib.PlacementFailed as e:  # received, never placed: the host's own inline call
      unplaced = _unplaced_payload(key, e.payload)
      with self.recorder.span(tracks.TRAINER_FALLBACK, key, reason=e.reason):
        response = self._observed(state, contract.FWD_BWD, original, (worker, unplaced), kwargs,
                                  unplaced)
      return contract.mark_placement_fallback(response, e.reason)
    with placements.handing(state.placement, staged) as handed:
      response = self._observed(state, contract.FWD_BWD, original, (worker, staged), kwargs)
    if not handed.passed:
      raise RuntimeError(f"fwd_bwd(stage_key={key!r}) did not reach the trainer's preparation "
                         "step; the staged batch was prepared for a trainer that prepares there")
    return contract.mark_placement_fallback(response, handed.fallback)

  def update(self, worker: Any, original: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
    """The host's update, its computation observed (it ends a step of the telemetry)."""
    return self._observed(self._chosen(worker), contract.UPDATE, original, (worker, *args),
                          kwargs)

  # ------------------------------------------------------------ observed for the telemetry

  def _observed(self, state: WorkerStaging, kind: str, call: Callable[..., Any],
                args: tuple[Any, ...], kwargs: dict[str, Any], payload: Any = None) -> Any:
    """`call(*args, **kwargs)` (the worker's fwd_bwd or update), its computation's output watched
    off this lane; a `peft_train` span where the trainer has a PerfTracer."""
    placement, target = state.placement, state.target
    if target is None:  # a trainer staging cannot serve: nothing to watch
      return call(*args, **kwargs)
    tracer = self._read(placement.tracer, target, TRACER)
    if tracer is not None:
      self._trace_into(tracer)
    logger = self._read(placement.metrics_logger, target, LOGGER)
    if logger is not None:
      self._log_into(placement, target, logger)
    started = time.perf_counter()
    inline = placements.timing(payload) if payload is not None else contextlib.nullcontext()
    with inline as prepared, contextlib.ExitStack() as stack:
      device_span = (None if tracer is None
                     else stack.enter_context(placement.computation_span(tracer, target)))
      try:
        result = call(*args, **kwargs)
        output = self._read(placement.computation, target, OUTPUT, kind)
      finally:  # the call's inline preparation, where it prepared one, returned or raised
        span = None if prepared is None else prepared.span
        if span is not None:
          self.recorder.add(tracks.TRAINER_H2D, "inline", *span, lane="inline",
                            bytes=nbytes(payload))
    if output is not None:
      queued = started if span is None else max(started, span[1])
      # An update answers the host's own step count (TrainerWorker.update -> int): the step its
      # loss is logged at, carried to the step's figures (`host_step`).
      step = {"host_step": int(result)} if kind == tracks.UPDATE and isinstance(
          result, (int, np.integer)) else {}
      self._watch(placement.host).dispatched(kind, queued, time.perf_counter(), output,
                                             on_ready=device_span, **step)
    elif device_span is not None:  # no output to watch: its device span ends with the call
      device_span()
    return result

  def _read(self, read: Callable[..., Any], target: Any, lacking: tuple[str, str],
            *args: Any) -> Any:
    """`read(target, *args)`, or None, said once per trainer type where it fails: it trains on."""
    try:
      return read(target, *args)
    except Exception as e:  # pylint: disable=broad-except  (telemetry never fails a training call)
      if self.inst.first_time(f"unobserved:{lacking[0]}:{type(target).__qualname__}"):
        log.warning("tunix-stage: telemetry: %s holds no %s (%s: %s); %s",
                    type(target).__qualname__, lacking[0], type(e).__name__, e, lacking[1])
      return None

  def _watch(self, host: str) -> recorder_lib.ComputeWatcher:
    """The computations' watcher, made with this process's trainer-side step figures on the
    first computation of a `host` trainer."""
    with self._lock:
      if self._watcher is None:
        self.inst.telemetry.trainer(host=host)
        self._watcher = recorder_lib.ComputeWatcher(self.recorder, jax.block_until_ready)
      return self._watcher

  def drain(self, timeout: float | None = None) -> bool:
    """Waits until every computation dispatched so far is recorded."""
    with self._lock:
      watcher = self._watcher
    return watcher is None or watcher.drain(timeout)

  def _trace_into(self, tracer: Any) -> None:
    """Tells `tracer` (a trainer's tunix PerfTracer) of the staging spans from now on (once)."""
    with self._lock:
      if any(t is tracer for t in self._tracers):
        return
      self._tracers.append(tracer)
    self.recorder.add_sink(peft.TracerSink(tracer))

  def _log_into(self, placement: Any, target: Any, logger: Any) -> None:
    """Tells `logger` each trainer step's figures from now on, where no logger is told yet: a
    logger's backends listen process-wide (jax.monitoring), so one reaches every backend."""
    with self._lock:
      if self._logger is not None:
        return
      self._logger = logger
    self.inst.telemetry.add_step_sink(placement.step_sink(target, logger))

  def _take_peaks(self) -> tuple[int, int]:
    """The most staged micro-batches held at once, over this node's workers, since last asked."""
    with self._lock:
      states = list(self._workers.values())
    peaks = [state.store.take_peaks() for state in states]
    return (sum(p[0] for p in peaks), sum(p[1] for p in peaks))

  # ------------------------------------------------------------ the bounds

  def _bound_pool(self) -> None:
    """The receive buffers in use at once: at most the micro-batches this node's workers may hold
    staged (their device and host bounds), counting those whose computation has not ended."""
    with self._lock:
      workers = max(1, len(self._workers))
    self.pool.set_bound(workers * (self._config.max_device_batches + self._host))

  def _host_bound_of(self, config: config_lib.StageConfig) -> int:
    """The host bound `config` puts in force; at auto, a sizer of it (a trainer step sink, made
    once) and the bound it holds (1 to start with)."""
    telemetry = self.inst.telemetry
    if not config_lib.is_auto(config.max_host_batches):
      return config.max_host_batches
    if self.host_bound is None:
      from tunix_stage_plugin.core import host_bound as host_bound_lib  # pylint: disable=import-outside-toplevel
      self.host_bound = host_bound_lib.HostBound(budget_bytes=config.memory_budget,
                                         device_bound=config.max_device_batches,
                                         apply=self._apply_host_bound)
      telemetry.add_step_sink(self.host_bound, record_lib.TRAINER)
    self.host_bound.budget_bytes = config.memory_budget
    self.host_bound.device_bound = config.max_device_batches
    telemetry.sized(record_lib.TRAINER, "max_host_batches", self.host_bound.bound,
                    self.host_bound.reason)
    return self.host_bound.bound

  def _apply_host_bound(self, bound: int, reason: str) -> None:
    """The host bound sized at auto: for later arrivals (what is held stays held)."""
    if not config_lib.is_auto(self._config.max_host_batches):
      return  # a re-install fixed it since
    self.inst.telemetry.sized(record_lib.TRAINER, "max_host_batches", bound, reason)
    self._set_bounds(bound)

  def _set_bounds(self, host: int) -> None:
    with self._lock:
      self._host = host
      states = list(self._workers.values())
    for state in states:
      state.store.set_bounds(self._config.max_device_batches, host)
    self._bound_pool()

  def reconfigure(self, config: config_lib.StageConfig) -> None:
    """A re-install with new bounds: applied to the live workers."""
    self._config = config
    self._set_bounds(self._host_bound_of(config))

  def close(self) -> None:
    """Drops every staged batch, ends the placers, closes every lane (bounded), listener and
    watcher and gives back the idle receive buffers; the hooks are going away."""
    with self._lock:
      states, self._workers = list(self._workers.values()), weakref.WeakKeyDictionary()
      sides, self.side_channels = list(self.side_channels.values()), weakref.WeakKeyDictionary()
      executors, self._executors = list(self._executors.values()), weakref.WeakKeyDictionary()
    for side in sides:
      side.listener.close()
    for state in states:
      state.store.close()
    for executor in executors:
      executor.close(timeout=CLOSE_TIMEOUT_S)
    for state in states:
      if state.placer is not None:
        state.placer.join(CLOSE_TIMEOUT_S)
    if self._watcher is not None:
      self._watcher.close()
    self._unplace_peft()
    self.pool.trim()


def _header_bytes(request: Any) -> bytes:
  if request.args or set(request.kwargs) != {contract.SIDE_HEADER}:
    raise wire.WireError(f"{contract.SIDE_CALL} takes one keyword argument, "
                         f"{contract.SIDE_HEADER} (bytes)")
  header = request.kwargs[contract.SIDE_HEADER]
  if not isinstance(header, bytes):
    raise wire.WireError(f"{contract.SIDE_CALL}'s header must be bytes; got "
                         f"{type(header).__name__}")
  return header


def _codec() -> Any:
  """The codec (core/codec.py), loaded once a compressed payload arrives."""
  from tunix_stage_plugin.core import codec  # pylint: disable=import-outside-toplevel
  return codec


def _unstageable(state: WorkerStaging, payload: Any) -> str | None:
  """Why `payload` can never be staged on this worker (None: it may be): a compressed payload
  this trainer cannot decode, or one its trainer's kind refuses. Asked before any wait."""
  try:
    if isinstance(payload, codec_spec.CompressedPayload):
      payload = _codec().check_payload(payload)
    if state.placement.check is not None:
      state.placement.check(payload)
  except Exception as e:  # pylint: disable=broad-except  (the reason travels back)
    return f"{type(e).__name__}: {e}"
  return None


def _unplaced_payload(key: str, payload: Any) -> Any:
  """A received batch that was never placed, as the host's inline fwd_bwd takes it."""
  if not isinstance(payload, codec_spec.CompressedPayload):
    return payload
  codec = _codec()
  try:
    return codec.decompress_payload(payload)
  except codec.CodecError as e:  # trains nothing: the orchestrator sends it inline
    raise contract.StagedPayloadUnreadable(
        f"staged batch {key!r} did not decode ({e}); send it with its train call") from None
