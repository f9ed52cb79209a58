"""Orchestrator process: `python -m tunix_stage_plugin.embedded.orchestrator_main --trainer ADDR`.

Connects to a trainer_main, trains `--steps` steps of `--microbatches` micro-batches and prints a
line per step plus one summary line (stage/fallbacks per step, the parameters' digest, whether
every micro-batch trained once and in order). Exit 0 on success; 1 with a one-line error when the
trainer cannot be reached, a call fails or the order is wrong; 2 for bad flags or settings.

Staging: TUNIX_STAGE_BATCH (off | stage) and TUNIX_MAX_STAGED_BATCHES, or --stage_train_batches /
--max_staged_batches (flags beat env). Off: every micro-batch is sent with its train call, as a
plain inline orchestrator. Stage: the core stage pipeline at that depth; with depth >= 2 the next
step's first micro-batches also stage across the step boundary.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any, Callable

from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import flags as flags_lib
from tunix_stage_plugin.embedded import client as client_lib
from tunix_stage_plugin.embedded import data as data_lib
from tunix_stage_plugin.embedded import engine as engine_lib
from tunix_stage_plugin.embedded import job as job_lib

PROG = "orchestrator_main"


def _number(kind: type, *, allow_zero: bool = False) -> Callable[[str], Any]:
  def parse(text: str) -> Any:
    try:
      value = kind(text)
    except ValueError:
      value = None
    if value is None or not (value >= 0 if allow_zero else value > 0) or value == float("inf"):
      raise argparse.ArgumentTypeError(
          f"{text!r}: accepted a{'n' if kind is int else ''} {kind.__name__} "
          f"{'>=' if allow_zero else '>'} 0")
    return value
  return parse


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog=f"python -m tunix_stage_plugin.embedded.{PROG}",
      description="Drive the embedded trainer: train steps of micro-batches, inline or staged.")
  parser.add_argument("--trainer", required=True, metavar="HOST:PORT",
                      help="the trainer_main address, e.g. 127.0.0.1:50051")
  parser.add_argument("--steps", type=_number(int), default=3, help="steps (default 3)")
  parser.add_argument("--microbatches", type=_number(int), default=4,
                      help="micro-batches per step (default 4)")
  parser.add_argument("--tiny", action="store_true", help="a tiny model (tests, smoke runs)")
  parser.add_argument("--payload_mib", type=_number(float), default=None, metavar="MIB",
                      help="bytes per micro-batch in MiB (default: 16 MiB, or ~1 KiB with --tiny)")
  parser.add_argument("--wire_mbps", type=_number(float), default=None, metavar="MB/S",
                      help="emulated wire bandwidth in MB/s (default: unpaced loopback)")
  parser.add_argument("--h2d_mbps", type=_number(float), default=None, metavar="MB/S",
                      help="emulated host-to-device bandwidth in MB/s (default: no emulation)")
  parser.add_argument("--sync_s", type=_number(float, allow_zero=True), default=0.0, metavar="S",
                      help="emulated weight sync closing each step, seconds (default 0)")
  parser.add_argument("--seed", type=int, default=0, help="parameters and data seed (default 0)")
  parser.add_argument("--connect_timeout_s", type=_number(float), default=60.0, metavar="S",
                      help="how long to wait for the trainer to answer (default 60)")
  parser.add_argument("--liveness_s", type=_number(float), default=client_lib.DEFAULT_LIVENESS_S,
                      metavar="S",
                      help="report the trainer as stopped answering when a call goes this long "
                      "past its expected time without a reply, or its connection's keepalive "
                      f"pings go unanswered (>= 1; default {client_lib.DEFAULT_LIVENESS_S:g})")
  flags_lib.add_argparse_flags(parser, flags_lib.ORCHESTRATOR_FIELDS)
  return parser


def plan_from(cfg: config_lib.StageConfig, args: argparse.Namespace) -> job_lib.JobPlan:
  if not cfg.enabled:
    return job_lib.JobPlan(args.steps, args.microbatches, kind="inline", sync_s=args.sync_s)
  return job_lib.JobPlan(args.steps, args.microbatches, kind="staged",
                         depth=cfg.max_staged_batches, prestage=cfg.max_staged_batches >= 2,
                         sync_s=args.sync_s)


async def run(args: argparse.Namespace, cfg: config_lib.StageConfig) -> int:
  sizes = data_lib.TINY_SIZES if args.tiny else data_lib.DEFAULT_SIZES
  if args.payload_mib is not None:
    sizes = sizes.with_payload_mib(args.payload_mib)
  plan = plan_from(cfg, args)
  wire_rate = None if args.wire_mbps is None else args.wire_mbps * 1e6
  async with client_lib.WorkerClient(args.trainer, wire_bytes_per_s=wire_rate,
                                     liveness_s=args.liveness_s) as client:
    await client.wait_ready(args.connect_timeout_s)
    trainer_mode = (await client.call("info"))["mode"]
    await client.call("setup", sizes=sizes.as_dict(), seed=args.seed, h2d_mbps=args.h2d_mbps,
                      record_timeline=False)
    batches = {(s, i): data_lib.make_batch(sizes, args.seed, s, i)
               for s in range(plan.steps) for i in range(plan.microbatches)}
    outcomes = await job_lib.run_job(
        engine_lib.EmbeddedEngine(client), plan, lambda s, i: batches[s, i],
        on_step=lambda o: print(f"{PROG}: {o.summary()}", flush=True))
    finish = await client.call("finish")
  expected = data_lib.expected_order(plan.steps, plan.microbatches)
  in_order = finish["trained_order"] == expected
  fallbacks = [o.report.fallbacks for o in outcomes]
  staging = (f"stage depth={plan.depth} prestage={'on' if plan.prestage else 'off'}"
             if plan.kind == "staged" else "off (inline)")
  print(f"{PROG}: {'OK' if in_order else 'FAILED'}: {plan.steps} steps x {plan.microbatches} "
        f"micro-batches, staging {staging}, trainer staging {trainer_mode}, "
        f"stage/fallbacks per step {fallbacks}, "
        f"stage/staged per step {[o.report.staged for o in outcomes]}, "
        f"final loss {outcomes[-1].loss:.4f}, param_digest {finish['param_digest'][:16]}, "
        f"trained once in order: {'yes' if in_order else 'NO'}", flush=True)
  if not in_order:
    print(f"{PROG}: error: trained order {finish['trained_order']} differs from {expected}",
          file=sys.stderr)
    return 1
  return 0


def main(argv: list[str] | None = None) -> int:
  os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
  args = build_parser().parse_args(argv)
  try:
    cfg = flags_lib.config_from_argparse(args, flags_lib.ORCHESTRATOR_FIELDS)
    client_lib.check_address(args.trainer)
    client_lib.check_liveness(args.liveness_s)
  except (config_lib.ConfigError, ValueError) as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2
  try:
    return asyncio.run(run(args, cfg))
  except client_lib.CALL_ERRORS as e:
    print(f"{PROG}: error: {client_lib.describe_call_error(e, f'the trainer at {args.trainer}')}", file=sys.stderr)
    return 1


if __name__ == "__main__":
  sys.exit(main())
