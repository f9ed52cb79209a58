"""RemoteExecutionServer (gRPC and in-process): a TrainerWorker's requests go through the executor.

The host runs a sync worker method inline on the server's event loop (for the in-process server,
the caller's loop), so a stage request waits behind a running fwd_bwd and behind the
step-boundary calls (update, weight sync). With the hook, a server bound to a TrainerWorker sends
trainer compute to one FIFO thread (arrival order, one thread touching trainer state, as on the
loop today), stage_batch to the staging thread, and answers heartbeat/info/reset_staged on the
loop at once (core.executor's lanes). Servers bound to anything else (rollout,
inference, tests' objects) run the host's code unchanged. The hook is on the base class, so the
gRPC server and the in-process one route alike; the gRPC server's stop_serving also joins the
executor's threads (an in-process server's go when the server is collected) and closes its
bulk side channel. The side channel's two methods (side.py) are answered here, before tunix's
dispatch, on any gRPC server that has one; tunix's own servers answer them AttributeError.

The compute thread does not inherit thread-local JAX contexts entered around the serving loop
(`with mesh:` around asyncio.run); bind the mesh in the trainer, as tunix's trainer node does.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from typing import Any

from tunix_stage_plugin.core import patching
from tunix_stage_plugin.hosts.tunix import installation as installation_lib
from tunix_stage_plugin.hosts.tunix import side as side_lib


def apply(registry: patching.PatchRegistry, inst: installation_lib.Installation,
          server_cls: type, grpc_server_cls: type, trainer_worker_cls: type) -> None:
  original_execute = server_cls.__dict__["execute_request"]
  original_stop = grpc_server_cls.__dict__["stop_serving"]

  @functools.wraps(original_execute)
  async def execute_request(self: Any, request: Any) -> Any:
    if request.method_name in side_lib.METHODS:
      side = inst.side_channels.get(self)
      if side is not None:
        return await side_lib.answer(inst, side, self, request)
    instance = self.bound_instance
    # The real type, not isinstance: tests bind spec'd mocks that claim to be TrainerWorkers.
    if not issubclass(type(instance), trainer_worker_cls):
      return await original_execute(self, request)
    name = request.method_name or "__call__"
    if inspect.iscoroutinefunction(getattr(instance, name, None)):
      return await original_execute(self, request)  # async methods leave the loop when they await
    # execute_sync_request is the host's own resolve-call-and-wrap-errors step.
    return await inst.executor_for(self).run(name, self.execute_sync_request, request)

  @functools.wraps(original_stop)
  async def stop_serving(self: Any, *args: Any, **kwargs: Any) -> Any:
    # No new bytes (its threads joined off the loop); calls already received run on their lanes.
    await asyncio.to_thread(side_lib.stop, inst, self)
    result = await original_stop(self, *args, **kwargs)
    executor = inst.pop_executor(self)
    if executor is not None:
      # Joins the lanes (a running fwd_bwd finishes first) without holding the loop.
      await asyncio.to_thread(executor.close)
    return result

  registry.set(server_cls, "execute_request", execute_request)
  registry.set(grpc_server_cls, "stop_serving", stop_serving)
