"""Orchestrator process: `python -m tunix_stage_plugin.lab.embedded.orchestrator_main --trainer ADDR`.

Trains `--steps` steps of `--microbatches` micro-batches against a trainer_main: a line per step
plus a summary (stage/fallbacks per step, the parameters' digest, whether every micro-batch
trained once and in order); exit 0, 1 (one-line error) or 2 (every bad flag or setting, a line
each, before connecting). Micro-batches are built as they are pulled, so memory does not grow
with --steps. Staging on runs the core stage pipeline at --max_staged_batches, prestaging the
next step's first micro-batches at depth >= 2 (at auto, a depth sized each step, prestaging).
docs/launching.md "Entry points for launch recipes".
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys

from tunix_stage_plugin.core import codec as codec_lib
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import flags as flags_lib
from tunix_stage_plugin.core import inputs as core_inputs
from tunix_stage_plugin.core.telemetry import process as telemetry_lib
from tunix_stage_plugin.lab import inputs
from tunix_stage_plugin.lab.embedded import client as client_lib
from tunix_stage_plugin.lab.embedded import data as data_lib
from tunix_stage_plugin.lab.embedded import job as job_lib

PROG = "orchestrator_main"


def build_parser() -> argparse.ArgumentParser:
  parser = flags_lib.Parser(
      prog=f"python -m tunix_stage_plugin.lab.embedded.{PROG}",
      description="Drive the embedded trainer: train steps of micro-batches, inline or staged.")
  parser.add_argument("--trainer", required=True, metavar="HOST:PORT",
                      help="the trainer_main address, e.g. 127.0.0.1:50051")
  parser.add_argument("--steps", default="3", metavar="N",
                      help=f"steps, 1 to {inputs.MAX_COUNT} (default 3)")
  parser.add_argument("--microbatches", default="4", metavar="N",
                      help=f"micro-batches per step, 1 to {inputs.MAX_COUNT} (default 4)")
  parser.add_argument("--tiny", action="store_true", help="a tiny model (tests, smoke runs)")
  parser.add_argument("--payload_mib", default=None, metavar="MIB",
                      help="bytes per micro-batch in MiB, 1/1024 to "
                      f"{inputs.MAX_PAYLOAD_MIB:g} (default: 16 MiB, or ~2 KiB with --tiny)")
  parser.add_argument("--payload", default=data_lib.PAYLOAD_DENSE, metavar="KIND",
                      help=f"what a micro-batch carries: {' | '.join(data_lib.PAYLOADS)} "
                      "(default dense; docs/bench.md \"The rl payload\")")
  parser.add_argument("--wire_mbps", default=None, metavar="MB/S",
                      help="emulated wire bandwidth in MB/s, > 0 (default: unpaced loopback)")
  parser.add_argument("--h2d_mbps", default=None, metavar="MB/S",
                      help="emulated host-to-device bandwidth in MB/s, > 0 (default: no emulation)")
  parser.add_argument("--sync_s", default="0", metavar="S",
                      help="emulated weight sync closing each step, seconds >= 0 (default 0)")
  parser.add_argument("--seed", default="0", metavar="N",
                      help=f"parameters and data seed, 0 to {inputs.SEED_LIMIT - 1} (default 0)")
  parser.add_argument("--connect_timeout_s", default="60", metavar="S",
                      help="how long to wait for the trainer to answer, seconds > 0 (default 60)")
  parser.add_argument("--liveness_s", default=f"{client_lib.DEFAULT_LIVENESS_S:g}", metavar="S",
                      help="report the trainer as stopped answering within half this bound "
                      "(calls in flight and a heartbeat unanswered), or when a call goes this "
                      "long past its expected time without a reply "
                      f"(>= 1; default {client_lib.DEFAULT_LIVENESS_S:g})")
  flags_lib.add_argparse_flags(parser, flags_lib.ORCHESTRATOR_FIELDS)
  return parser


def plan_from(settings: Settings) -> job_lib.JobPlan:
  s, cfg = settings, settings.cfg
  if not cfg.enabled:
    return job_lib.JobPlan(s.steps, s.microbatches, kind="inline", sync_s=s.sync_s)
  auto = config_lib.is_auto(cfg.max_staged_batches)
  depth = config_lib.fixed("max_staged_batches", cfg.max_staged_batches)
  return job_lib.JobPlan(s.steps, s.microbatches, kind="staged", depth=depth,
                         prestage=auto or depth >= 2, sync_s=s.sync_s, auto=auto,
                         budget_bytes=cfg.memory_budget)


@dataclasses.dataclass(frozen=True)
class Settings:
  """The checked flags (see check)."""

  trainer: str
  steps: int
  microbatches: int
  sizes: data_lib.Sizes
  wire_mbps: float | None
  h2d_mbps: float | None
  sync_s: float
  seed: int
  connect_timeout_s: float
  liveness_s: float
  cfg: config_lib.StageConfig


def check(args: argparse.Namespace) -> tuple[Settings | None, list[str]]:
  """Every flag and staging setting at once: (settings, []) or (None, one line per problem)."""
  p = inputs.Problems()
  steps = p.take("--steps", args.steps, inputs.count)
  microbatches = p.take("--microbatches", args.microbatches, inputs.count)
  payload = p.take("--payload_mib", args.payload_mib, inputs.payload_mib)
  wire = p.take("--wire_mbps", args.wire_mbps, inputs.positive)
  h2d = p.take("--h2d_mbps", args.h2d_mbps, inputs.positive)
  sync_s = p.take("--sync_s", args.sync_s, inputs.nonnegative)
  seed = p.take("--seed", args.seed, inputs.seed)
  timeout = p.take("--connect_timeout_s", args.connect_timeout_s, inputs.positive)
  p.take("--payload", args.payload, inputs.one_of(data_lib.PAYLOADS))
  liveness = p.take("--liveness_s", args.liveness_s,
                    lambda text: inputs.number(text, at_least=1.0))
  for field in flags_lib.ORCHESTRATOR_FIELDS:  # each setting alone, so every bad one is named
    setting = config_lib.SETTINGS_BY_FIELD[field]
    try:
      config_lib.resolve({field: getattr(args, setting.flag)},
                         env={setting.env: os.environ.get(setting.env, "")},
                         explicit_source="flag")
    except config_lib.ConfigError as e:
      p.lines += e.problems
  try:
    client_lib.check_address(args.trainer)
  except ValueError:
    p.refuse("--trainer", args.trainer, "HOST:PORT with PORT in 1..65535 (e.g. 127.0.0.1:50051)")
  if p:
    return None, p.lines
  cfg = flags_lib.config_from_argparse(args, flags_lib.ORCHESTRATOR_FIELDS)
  sizes = data_lib.TINY_SIZES if args.tiny else data_lib.DEFAULT_SIZES
  sizes = sizes.with_payload(args.payload)
  if payload is not None:
    sizes = sizes.with_payload_mib(payload)
  # One bulk array per position of a step (data.BatchMaker), shared by every step.
  memory = inputs.memory_refusal(sizes.payload_bytes, microbatches,
                                 "one per position of a step, --microbatches")
  if memory is not None:
    return None, [core_inputs.refusal("--payload_mib", args.payload_mib, memory)]
  return Settings(args.trainer, steps, microbatches, sizes, wire, h2d, sync_s, seed, timeout,
                  liveness, cfg), []


async def run(settings: Settings) -> int:
  sizes, seed = settings.sizes, settings.seed
  plan = plan_from(settings)
  wire_rate = None if settings.wire_mbps is None else settings.wire_mbps * 1e6
  async with client_lib.WorkerClient(settings.trainer, wire_bytes_per_s=wire_rate,
                                     liveness_s=settings.liveness_s) as client:
    await client.wait_ready(settings.connect_timeout_s)
    trainer_mode = (await client.call("info"))["mode"]
    await client.call("setup", sizes=sizes.as_dict(), seed=seed, h2d_mbps=settings.h2d_mbps,
                      record_timeline=False)
    # Built when pulled; the bulk arrays once per position (data.BatchMaker): memory does not grow
    # with --steps.
    codec = codec_lib.parse(settings.cfg.codec) if plan.kind == "staged" else None
    engine = client_lib.EmbeddedEngine(client, codec=codec)
    telemetry = (telemetry_lib.Telemetry(telemetry_lib.Settings.of("embedded", settings.cfg))
                 if settings.cfg.enabled else None)
    try:
      outcomes = await job_lib.run_job(
          engine, plan,
          data_lib.BatchMaker(sizes, seed), telemetry=telemetry,
          on_step=lambda o: print(f"{PROG}: {o.summary()}", flush=True))
    finally:
      if telemetry is not None:
        telemetry.close()
    finish = await client.call("finish")
  expected = data_lib.expected_order(plan.steps, plan.microbatches)
  in_order = finish["trained_order"] == expected
  fallbacks = [o.report.fallbacks for o in outcomes]
  depth = f"auto (per step {[o.depth for o in outcomes]})" if plan.auto else plan.depth
  staging = (f"stage depth={depth} prestage={'on' if plan.prestage else 'off'}"
             if plan.kind == "staged" else "off (inline)")
  if codec is not None:
    ratio = engine.wire.ratio
    staging += (f" codec={codec} (stage bytes sent {engine.wire.stage_sent_bytes} of "
                f"{engine.wire.stage_raw_bytes}, ratio {ratio:.2f})" if ratio else f" codec={codec}")
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
  settings, problems = check(args)
  if settings is None:
    for line in problems:
      print(f"{PROG}: error: {line}", file=sys.stderr)
    return 2
  try:
    return asyncio.run(run(settings))
  except client_lib.CALL_ERRORS as e:
    where = f"the trainer at {settings.trainer}"
    print(f"{PROG}: error: {client_lib.describe_call_error(e, where)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
  sys.exit(main())
