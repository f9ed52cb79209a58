"""tunix's trainer servers (RemoteExecutionServer, gRPC and in-process): where every received call
enters the plugin, and where the side channel and the chunked stream start and stop with tunix's
server (docs/tunix.md "What it hooks").

Traps specific to this code: grpc takes handlers only before start, so the stream's method is added
when tunix assigns `_server` inside the wrapped `start_serving_async` (a property for that one
moment; the value stays in the instance's `__dict__`). `stop_serving` stops the side channel first
(no new bytes), then tunix's stop, then drops the worker's staged batches (nothing can train them)
and joins the server's lanes; an in-process server's lanes go when the server is collected.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from typing import Any

from tunix.experimental.worker import remote_execution

from tunix_stage_plugin.core import patching
from tunix_stage_plugin.hosts.tunix import contract
from tunix_stage_plugin.hosts.tunix import installation as installation_lib
from tunix_stage_plugin.hosts.tunix import lanes as lanes_lib
from tunix_stage_plugin.hosts.tunix import side as side_lib
from tunix_stage_plugin.hosts.tunix import stream as stream_lib

# The server whose start_serving_async is running in this context (its grpc server gets the
# stream's handler when tunix assigns it).
_starting: contextvars.ContextVar[Any] = contextvars.ContextVar("tunix_stage_starting_server",
                                                                default=None)


def apply(registry: patching.PatchRegistry, inst: installation_lib.Installation,
          server_cls: type, grpc_server_cls: type, trainer_worker_cls: type) -> None:
  original_execute = server_cls.__dict__["execute_request"]
  original_start = grpc_server_cls.__dict__["start_serving_async"]
  original_stop = grpc_server_cls.__dict__["stop_serving"]
  inst.lanes = lanes_lib.Lanes(original_execute, trainer_worker_cls, inst.recorder,
                               remote_execution.ExecutionRequest,
                               remote_execution.ExecutionResponse)

  @functools.wraps(original_execute)
  async def execute_request(self: Any, request: Any) -> Any:
    if request.method_name in contract.SIDE_METHODS:
      side = inst.side_channels.get(self)
      if side is not None:
        return await side_lib.answer(inst, side, self, request)
    return await inst.lanes.dispatch(self, request, lanes_lib.Receipt(
        contract.UNARY, request.method_name or "__call__"))

  def get_server(self: Any) -> Any:
    return self.__dict__.get("_server")

  def set_server(self: Any, value: Any) -> None:
    self.__dict__["_server"] = value
    if value is not None and _starting.get() is self:  # tunix made it and has not started it yet
      value.add_generic_rpc_handlers((stream_lib.handler(inst, self),))
      inst.streaming_servers.add(self)

  @functools.wraps(original_start)
  async def start_serving_async(self: Any, *args: Any, **kwargs: Any) -> Any:
    token = _starting.set(self)
    try:
      result = await original_start(self, *args, **kwargs)
    finally:
      _starting.reset(token)
    if self in inst.streaming_servers and inst.serve_side_channel:
      side_lib.listen(inst, self)  # started with tunix's server; stop_serving closes it
    return result

  @functools.wraps(original_stop)
  async def stop_serving(self: Any, *args: Any, **kwargs: Any) -> Any:
    # No new bytes (its threads joined off the loop); calls already received run on their lanes.
    await asyncio.to_thread(side_lib.stop, inst, self)
    result = await original_stop(self, *args, **kwargs)
    executor = inst.lanes.pop(self)
    if executor is not None:
      # No call comes any more: its staged batches can never be trained. Dropping them frees their
      # device slots, so a placement waiting for one returns now (not after its slot wait).
      inst.drop_staged(self.bound_instance)
      # Joins the lanes (a running fwd_bwd finishes first) without holding the loop.
      await asyncio.to_thread(executor.close)
    return result

  registry.set(server_cls, "execute_request", execute_request)
  registry.set(grpc_server_cls, "_server", property(get_server, set_server))
  registry.set(grpc_server_cls, "start_serving_async", start_serving_async)
  registry.set(grpc_server_cls, "stop_serving", stop_serving)
