"""Where a micro-batch's bytes go: one inline and one staged micro-batch, both processes measured.

    python tools/profile_host_path.py [--payload_mib 1024] [--markdown]

Starts an embedded trainer process with tracemalloc on (PYTHONTRACEMALLOC=1), compiles with one
inline micro-batch, then sends one micro-batch inline (fwd_bwd carrying it) and one staged
(stage_batch, then fwd_bwd by key), and reports per step, on each side:
- the payload bytes through its sockets (sent from the arrays' own memory; received straight
  into the buffer that is placed): one copy between the kernel and the process per byte, and no
  other copy, since a copy needs a payload-sized destination and the next column shows none;
- the most Python-allocated bytes above the step's start (tracemalloc: numpy buffers and every
  bytes object; a payload-sized temporary shows here);
- the peak resident bytes above the step's start (VmHWM), and the trainer's pooled receive buffers.
docs/performance.md shows its output.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tracemalloc

from tunix_stage_plugin.lab import rss
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.lab.embedded import client as client_lib
from tunix_stage_plugin.lab.embedded import data as data_lib
from tunix_stage_plugin.lab.embedded import process as process_lib

GIB = 1 << 30


def _deltas(before: dict, after: dict, moved: int) -> dict[str, int | None]:
  traced = (None if before["traced"] is None else
            after["traced"]["peak"] - before["traced"]["current"])
  return {"moved": moved, "traced_peak": traced, "rss_peak": after["peak"] - before["rss"]}


async def _received(client: client_lib.WorkerClient) -> int:
  return sum(dict(s.args)["bytes"] for s in await client.call("timeline")
             if s.track == tracks.TRAINER_RECEIVE)


async def _profile(address: str, sizes: data_lib.Sizes) -> list[tuple[str, dict, dict, int]]:
  make = data_lib.BatchMaker(sizes, 0)
  rows = []
  async with client_lib.WorkerClient(address) as client:
    await client.wait_ready()
    await client.call("setup", sizes=sizes.as_dict(), seed=0)
    await client.call("fwd_bwd", make(0, 0))  # compiles; its receive buffer joins the pool
    await client.call("setup", sizes=sizes.as_dict(), seed=0)  # the pool given back
    for name, staged in (("inline", False), ("staged", True)):
      batch = make(1, int(staged))
      sent, received = client.bulk_sent_bytes, await _received(client)
      here = rss.report(reset=True, top=0)
      there = await client.call("memory", reset=True)
      if staged:
        await client.call("stage_batch", batch, key="profile-1")
        await client.call("fwd_bwd", stage_key="profile-1")
      else:
        await client.call("fwd_bwd", batch)
      here_after = rss.report(top=0)
      there_after = await client.call("memory")
      rows.append((name, _deltas(here, here_after, client.bulk_sent_bytes - sent),
                   _deltas(there, there_after, await _received(client) - received),
                   there_after["pool_held_bytes"]))
  return rows


def _gib(value: int | None) -> str:
  return "-" if value is None else f"{value / GIB:.2f}"


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
  parser.add_argument("--payload_mib", type=float, default=1024.0)
  parser.add_argument("--markdown", action="store_true", help="print a markdown table")
  args = parser.parse_args(argv)
  sizes = data_lib.DEFAULT_SIZES.with_payload_mib(args.payload_mib)
  tracemalloc.start()
  env = {**os.environ, "PYTHONTRACEMALLOC": "1"}
  with process_lib.TrainerProcess(max_device_batches=1, env=env) as trainer:
    rows = asyncio.run(_profile(trainer.address, sizes))
  payload = sizes.payload_bytes
  header = ("step", "side", "socket bytes (kernel copies)", "Python-allocated peak GiB",
            "resident peak GiB", "pooled receive buffers GiB")
  lines = []
  for name, orch, train, pool in rows:
    lines.append((name, "orchestrator", f"{_gib(orch['moved'])} sent "
                  f"({orch['moved'] / payload:.2f} per byte)", _gib(orch["traced_peak"]),
                  _gib(orch["rss_peak"]), "-"))
    lines.append((name, "trainer", f"{_gib(train['moved'])} received "
                  f"({train['moved'] / payload:.2f} per byte)", _gib(train["traced_peak"]),
                  _gib(train["rss_peak"]), _gib(pool)))
  print(f"one micro-batch of {payload / GIB:.2f} GiB, each step measured on both sides")
  if args.markdown:
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in lines:
      print("| " + " | ".join(row) + " |")
  else:
    widths = [max(len(r[i]) for r in (header, *lines)) for i in range(len(header))]
    for row in (header, *lines):
      print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
