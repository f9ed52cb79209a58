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

    python tools/measure_tunix_path.py --job [--runs 3] [--max_device_batches 2]
        [--max_staged_batches 2]

measures instead the 256 MiB job of tests/hosts/tunix/test_grpc.py (2 steps x 4 micro-batches of
256 MiB through a real StandardRLProgram) once per run on a fresh node, over the side channel and
through the chunked stream: per run the wall, the trainer node's RSS before the job and its peak,
the receive buffers the pool made and reused, and the store's peak counts (device, host).
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
from tunix_stage_plugin.hosts.tunix import orchestrator
from tunix_stage_plugin.hosts.tunix.adapter import ADAPTER

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
    await ADAPTER.installation.orchestrator_side().close_connections()
    await handle.close()
  return found


def measure_job(runs: int, max_device_batches: int, max_staged_batches: int) -> None:
  """Prints one line per run and path of the 256 MiB job (--job)."""
  payloads = [micro_batch(256, n) for n in range(node_lib.STEPS * node_lib.MICRO)]
  print(f"256 MiB job, TUNIX_STAGE_MAX_DEVICE_BATCHES={max_device_batches}, "
        f"TUNIX_MAX_STAGED_BATCHES={max_staged_batches}")
  for path, worker in (("side channel", "bulk_big"), ("chunked stream", "all_over_cap")):
    for run in range(runs):
      # pylint: disable-next=protected-access
      proc, ports = node_lib._start_node("plugin", max_device_batches)
      try:
        port = ports[worker]
        baseline = node_lib.reset_peak_rss(port)
        start = time.perf_counter()
        _, _, reports = node_lib.run_program(
            port, staged=True, payloads=payloads,
            settings={"max_staged_batches": max_staged_batches})
        wall = time.perf_counter() - start
        seen, peak = node_lib.trained(port)
        if seen != [node_lib.fingerprint(p["experts"]) for p in payloads]:
          raise RuntimeError(f"{path}: the trainer did not train each micro-batch once, in order")
        pool, store = node_lib.pool_stats(port), node_lib.ask_node(port, "store_stats")
        staged = sum(r.stage_metrics["stage/staged"] for r in reports)
        print(f"{path} run {run + 1}: {wall:.1f} s, peak RSS {peak / GIB:.2f} GiB (from "
              f"{baseline / GIB:.2f}, +{(peak - baseline) / GIB:.2f}); receive buffers "
              f"{pool['made']} made, {pool['reused']} reused (bound {pool['bound']} transfers: "
              f"{pool['bound_waits']} waited, {pool['over_bound']} over); store peak {store['peak']} "
              f"device, {store['peak_host']} host; {staged} staged", flush=True)
      finally:
        node_lib._stop_node(proc)  # pylint: disable=protected-access


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
  parser.add_argument("--sizes_mib", default="16,64,120,1024",
                      help="micro-batch sizes in MiB, comma-separated (default: 16,64,120,1024)")
  parser.add_argument("--runs", type=int, default=3, help="timed runs per size (default: 3)")
  parser.add_argument("--job", action="store_true",
                      help="measure the 256 MiB job per run instead of stage_batch per size")
  parser.add_argument("--max_device_batches", type=int, default=2,
                      help="--job: the trainer's TUNIX_STAGE_MAX_DEVICE_BATCHES (default: 2)")
  parser.add_argument("--max_staged_batches", type=int, default=2,
                      help="--job: the orchestrator's TUNIX_MAX_STAGED_BATCHES (default: 2)")
  args = parser.parse_args()
  if args.job:
    measure_job(args.runs, args.max_device_batches, args.max_staged_batches)
    return
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
