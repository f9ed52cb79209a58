"""Measures the stage codecs (TUNIX_STAGE_CODEC) on the bench's rl payload: ratio, pack and unpack
GB/s (of raw bytes), at 1 thread and at every core this process may use.

  python tools/measure_codecs.py [--payload_mib 16] [--repeats 3] [--markdown]

Each figure is the best of --repeats runs of the embedded host's pack_arrays / unpack_arrays
(lab/embedded/data.py) over one whole micro-batch (crc32 included, as staging does it), so it is
what one stage pays. lz4 is single-threaded
(its "all" row repeats the 1-thread run); zstd decodes on one thread whatever it was packed with.
Needs the codec extra: pip install 'tunix-stage-plugin[codec]'.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time

from tunix_stage_plugin.core import codec as codec_lib
from tunix_stage_plugin.lab.embedded import data as data_lib

SPECS = ("blosc2-lz4:1", "blosc2-lz4:5", "blosc2-zstd:1", "blosc2-zstd:3")


def _best(fn, repeats: int) -> tuple[float, object]:
  best, value = float("inf"), None
  for _ in range(repeats):
    start = time.perf_counter()
    value = fn()
    best = min(best, time.perf_counter() - start)
  return best, value


def measure(payload_mib: float, repeats: int) -> list[dict]:
  sizes = data_lib.DEFAULT_SIZES.with_payload(data_lib.PAYLOAD_RL).with_payload_mib(payload_mib)
  batch = data_lib.make_batch(sizes, 0, 0, 0)
  cores = len(os.sched_getaffinity(0))
  rows = []
  for spec in SPECS:
    name = spec.partition(":")[0]
    if not codec_lib.installed(name):
      print(f"skipped {spec}: {codec_lib.MODULES[name]} not installed ({codec_lib.EXTRA})",
            file=sys.stderr)
      continue
    for threads in (1, cores):
      codec = dataclasses.replace(codec_lib.parse(spec), threads=threads)
      pack_s, packed = _best(lambda: data_lib.pack_arrays(codec, batch.arrays), repeats)
      unpack_s, _ = _best(lambda: data_lib.unpack_arrays(packed, threads=threads), repeats)
      raw = packed.nbytes
      rows.append({"codec": spec, "threads": threads, "ratio": raw / packed.wire_bytes,
                   "pack_gbps": raw / pack_s / 1e9, "unpack_gbps": raw / unpack_s / 1e9,
                   "raw_bytes": raw, "wire_bytes": packed.wire_bytes})
  return rows


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--payload_mib", type=float, default=16.0)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--markdown", action="store_true", help="print a README table")
  args = parser.parse_args(argv)
  rows = measure(args.payload_mib, args.repeats)
  print(f"rl payload {args.payload_mib:g} MiB, {len(os.sched_getaffinity(0))} cores "
        f"({platform.processor() or platform.machine()}), Python {platform.python_version()}, "
        f"best of {args.repeats}")
  if args.markdown:
    print("| codec:level | threads | ratio | pack GB/s | unpack GB/s |")
    print("|---|---:|---:|---:|---:|")
  for r in rows:
    if args.markdown:
      print(f"| {r['codec']} | {r['threads']} | {r['ratio']:.2f} | {r['pack_gbps']:.2f} | "
            f"{r['unpack_gbps']:.2f} |")
    else:
      print(f"{r['codec']:<14} threads {r['threads']:>2}  ratio {r['ratio']:6.2f}  "
            f"pack {r['pack_gbps']:6.2f} GB/s  unpack {r['unpack_gbps']:6.2f} GB/s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
