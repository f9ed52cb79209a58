"""One bulk call's two halves sent together: its header (on the host's gRPC call) and its bytes
(on the bulk channel, bulk.BulkSender). The header's answer decides: a refusal by the header ends
the send; a send that broke leaves the call a grace period to bring its own answer (the trainer
drops the bytes' connection after refusing, so the send may fail first), then its error is the
call's. Whatever ends the call, both halves are cancelled and awaited: no send outlives its call
(a half-sent frame's connection is closed, never reused). docs/tunix.md "Which path a call takes".
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Sequence

from tunix_stage_plugin.transport import bulk as bulk_lib


async def call_with_bytes(rpc: Awaitable[Any], sender: bulk_lib.BulkSender, transfer: bytes,
                          buffers: Sequence[memoryview], grace_s: float, pace: float = 1.0
                          ) -> Any:
  """Awaits `rpc` (the header's call) while `sender` sends `buffers` under `transfer`."""
  call = asyncio.ensure_future(rpc)
  send = asyncio.ensure_future(sender.send(transfer, buffers, pace))
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
