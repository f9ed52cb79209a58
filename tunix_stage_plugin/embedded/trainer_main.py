"""Trainer process: `python -m tunix_stage_plugin.embedded.trainer_main --port PORT`.

Serves the embedded trainer worker on 127.0.0.1:PORT until SIGTERM or SIGINT, then stops the
server, joins its lane threads and exits 0. Prints `READY 127.0.0.1:PORT` (flushed) once serving;
`--port 0` picks a free port and the line names it. Logs go to stderr.

Staging: TUNIX_STAGE_BATCH (off | stage) and TUNIX_STAGE_MAX_DEVICE_BATCHES, or the flags below
(flags beat env). With staging off it is a plain inline trainer that never starts a staging thread.
"""

from __future__ import annotations

import os
import sys

# JAX reads these once, at import: a 2-device CPU mesh unless the launcher chose otherwise.
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
if _DEVICE_COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_COUNT_FLAG}=2".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

# pylint: disable=wrong-import-position
import argparse
import asyncio
import logging
import signal

from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import flags as flags_lib
from tunix_stage_plugin.embedded import server as server_lib
from tunix_stage_plugin.embedded import worker as worker_lib

log = logging.getLogger("tunix_stage_plugin.embedded")


def _port(text: str) -> int:
  if not (text.isascii() and text.isdigit()) or int(text) > 65535:
    raise argparse.ArgumentTypeError(f"{text!r}: accepted an integer in 0..65535 (0: any free port)")
  return int(text)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="python -m tunix_stage_plugin.embedded.trainer_main",
      description="Serve the embedded JAX trainer over gRPC on 127.0.0.1 until SIGTERM/SIGINT.")
  parser.add_argument("--port", type=_port, required=True,
                      help="TCP port on 127.0.0.1 (0: any free port, named in the READY line)")
  flags_lib.add_argparse_flags(parser, ["mode"])
  setting = config_lib.SETTINGS_BY_FIELD["max_device_batches"]
  parser.add_argument("--max_device_batches", f"--{setting.flag}", dest=setting.flag,
                      default=None, metavar="N",
                      help=f"{setting.help} Overrides ${setting.env}; default {setting.default}.")
  parser.add_argument("--fail_stage_ids", default="", metavar="IDS",
                      help="testing: comma-separated micro-batch ids (e.g. s1-m2) whose stage "
                      "fails in the worker, to exercise the inline fallback")
  parser.add_argument("--log_level", default="WARNING",
                      choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="stderr log level")
  return parser


async def serve(port: int, cfg: config_lib.StageConfig, fail_stage: frozenset[str]) -> None:
  worker = worker_lib.TrainerWorker(cfg, fail_stage=fail_stage)
  executor = worker_lib.make_executor(cfg)
  server = server_lib.WorkerServer(worker, executor, timeline=worker.recorder)
  stop = asyncio.Event()
  loop = asyncio.get_running_loop()
  for sig in (signal.SIGTERM, signal.SIGINT):
    loop.add_signal_handler(sig, stop.set)
  try:
    bound = await server.start(port)
    print(f"READY {server_lib.BIND_HOST}:{bound}", flush=True)
    log.info("serving on %s:%d (%s)", server_lib.BIND_HOST, bound, cfg.as_dict())
    await stop.wait()
  finally:
    await server.stop(grace=1.0)
    executor.close()  # waits for the lane threads' current work, then joins them


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  logging.basicConfig(level=args.log_level, stream=sys.stderr,
                      format="trainer %(levelname)s %(message)s")
  try:
    cfg = flags_lib.config_from_argparse(args, flags_lib.TRAINER_FIELDS)
  except config_lib.ConfigError as e:
    print(f"trainer_main: error: {e}", file=sys.stderr)
    return 2
  fail_stage = frozenset(filter(None, (s.strip() for s in args.fail_stage_ids.split(","))))
  try:
    asyncio.run(serve(args.port, cfg, fail_stage))
  except OSError as e:
    print(f"trainer_main: error: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
