"""One bulk call's two halves sent together: its header (on the host's gRPC call) and its bytes
(on the bulk channel, bulk.BulkSender). The header goes out once a connection for the bytes is
held within the listener's cap (bulk.Lease: a call waits for one while its sender's are all in
use). The header's answer decides: a refusal by the header ends the send; a send that broke
leaves the call a grace period to bring its own answer (the trainer drops the bytes' connection
after refusing, so the send may fail first), then its error is the call's. Whatever ends the
call, both halves are cancelled and awaited and the lease ended: no send outlives its call (a
half-sent frame's connection is closed, never reused). docs/tunix.md "Which path a call takes",
docs/embedded.md "Limits of the bulk channel".
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Sequence

from tunix_stage_plugin.transport import bulk as bulk_lib


async def call_with_bytes(rpc: Awaitable[Any], sender: bulk_lib.BulkSender,
                          transfer: bytes, buffers: Sequence[memoryview], grace_s: float,
                          pace: float = 1.0) -> Any:
  """Awaits `rpc` (the header's call, started once a connection is held) while `sender` sends
  `buffers` under `transfer`."""
  try:
    lease = await sender.lease()
  except BaseException:
    if asyncio.iscoroutine(rpc):
      rpc.close()  # never started
    else:
      asyncio.ensure_future(rpc).cancel()
    raise
  call = asyncio.ensure_future(rpc)
  send = asyncio.ensure_future(sender.send(lease, transfer, buffers, pace))
  try:
    await asyncio.wait({call, send}, return_when=asyncio.FIRST_COMPLETED)
    if not call.done() and send.exception() is not None:
      await asyncio.wait({call}, timeout=grace_s)
      if not call.done():
        raise send.exception()
    return await call
  finally:
    for task in (call, send):
      task.cancel()
    await asyncio.gather(call, send, return_exceptions=True)
    lease.end()
