"""stage_batch's speed on tunix's host: the bulk side channel against the path without it.

    python tools/measure_tunix_path.py [--sizes_mib 16,64,120,1024] [--runs 3]

Starts the tunix trainer node of tests/hosts/tunix/test_grpc.py (a real GrpcRemoteExecutionServer,
TrainerWorker and PeftTrainer on a 2-device CPU mesh, the plugin installed) and, from this
process as the orchestrator, times `stage_train_batch` of one micro-batch per size on two of its
workers: 'bulk' (the side channel) and 'over_cap' (served without it: tunix's unary call under
its 128 MiB cap, the chunked stream over it), each path on a fresh node of its own (the workers of
one node share its receive buffers, so the second path's first call would find them made). Each
size is staged once first (its receive buffers made: that first call is reported on its own),
then `--runs` times; each stage is dropped again (reset) before the next. Prints a markdown table
of the medians, and each node's peak RSS. Needs tunix's experimental stack (docs/tunix.md).
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# pylint: disable=wrong-import-position
from tunix.experimental.orchestrator import distributed_rl_engine

from tests.hosts.tunix import test_grpc as node_lib
from tunix_stage_plugin.activation import manager
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.hosts.tunix import stream

GIB = 1 << 30
TOP_K = 512  # a micro-batch's routed-expert ids are (8, 16, layers, TOP_K) int16: 128 KiB a layer


def micro_batch(mib: int, seed: int) -> dict:
  layers = mib * 8  # 128 KiB a layer
  return node_lib.batch(seed, layers, TOP_K, node_lib.BIG_ROUTED)


async def time_stages(port: int, sizes: list[int], runs: int) -> dict[int, tuple[float, float]]:
  """Per size: the first stage's seconds and the median of `runs` more."""
  handle = node_lib.connect(port)
  engine = distributed_rl_engine.DistributedRLEngine([], {node_lib.ACTOR: handle})
  found = {}
  try:
    for mib in sizes:
      payload = micro_batch(mib, mib)
      times = []
      for run in range(runs + 1):
        key = f"m-{mib}-{run}"
        start = time.perf_counter()
        outcome = await engine.stage_train_batch(payload, key=key)
        times.append(time.perf_counter() - start)
        if not outcome.staged:
          raise RuntimeError(f"{mib} MiB was not staged: {outcome}")
        await engine.reset_staged_batches([key])
      found[mib] = (times[0], statistics.median(times[1:]))
      del payload
  finally:
    await stream.close_streams(engine)
    await handle.close()
  return found


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
  parser.add_argument("--sizes_mib", default="16,64,120,1024",
                      help="micro-batch sizes in MiB, comma-separated (default: 16,64,120,1024)")
  parser.add_argument("--runs", type=int, default=3, help="timed runs per size (default: 3)")
  args = parser.parse_args()
  sizes = [int(s) for s in args.sizes_mib.split(",")]
  results, memory = {}, {}
  manager.install(config_lib.resolve({"mode": "stage"}, env={}), quiet=True)
  try:
    for path, worker in (("side channel", "bulk"), ("without it", "over_cap")):
      proc, ports = node_lib._start_node("plugin")  # pylint: disable=protected-access
      try:
        baseline = node_lib.reset_peak_rss(ports[worker])
        results[path] = asyncio.run(time_stages(ports[worker], sizes, args.runs))
        memory[path] = (baseline, node_lib.ask_node(ports[worker], "peak_rss"))
      finally:
        node_lib._stop_node(proc)  # pylint: disable=protected-access
  finally:
    manager.uninstall("tunix", quiet=True)
  cap = 128
  print("| micro-batch | path without the side channel | without: s (GiB/s) | side channel: s "
        "(GiB/s) | first call, without / side channel: s |")
  print("|---|---|---:|---:|---:|")
  for mib in sizes:
    without, side = results["without it"][mib], results["side channel"][mib]
    gib = mib / 1024
    name = "tunix's unary call" if mib < cap else "the chunked stream"
    print(f"| {mib} MiB | {name} | {without[1]:.3f} ({gib / without[1]:.2f}) | {side[1]:.3f} "
          f"({gib / side[1]:.2f}) | {without[0]:.3f} / {side[0]:.3f} |")
  print("\ntrainer node peak RSS: " + "; ".join(
      f"{path} {peak / GIB:.2f} GiB (from {baseline / GIB:.2f})"
      for path, (baseline, peak) in memory.items())
      + f"; medians of {args.runs} runs after one first call")


if __name__ == "__main__":
  main()
