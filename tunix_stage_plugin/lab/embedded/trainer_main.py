"""Trainer process: `python -m tunix_stage_plugin.lab.embedded.trainer_main --port PORT`.

Serves the embedded trainer worker on 127.0.0.1:PORT, printing `READY 127.0.0.1:PORT` (flushed)
once serving (`--port 0`: a free port, named in that line); logs go to stderr. A second
SIGTERM/SIGINT while stopping exits at once with 128 + the signal number. Flags, settings and
the stop sequence (exit 0, or 3 when calls were abandoned): docs/launching.md "Entry points
for launch recipes", docs/embedded.md "Stopping the trainer".
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
import ctypes
import logging
import signal
import stat
from typing import Any, Callable

from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import flags as flags_lib
from tunix_stage_plugin.lab import inputs
from tunix_stage_plugin.lab.embedded import server as server_lib
from tunix_stage_plugin.lab.embedded import worker as worker_lib

log = logging.getLogger("tunix_stage_plugin.lab.embedded")

EXIT_ABANDONED = 3  # stopped as asked, but calls still running after the grace were abandoned
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
PARENT_WATCHES = ("off", "pipe", "signal", "both")
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


MAX_CALL_MIB = 1 << 30  # 1 PiB: far above any call, low enough that a typo is refused
_port = inputs.argparse_type(inputs.port)
_non_negative = inputs.argparse_type(inputs.nonnegative)
_mib = inputs.argparse_type(lambda text: inputs.integer(text, minimum=1, maximum=MAX_CALL_MIB))


def build_parser() -> argparse.ArgumentParser:
  parser = flags_lib.Parser(
      prog="python -m tunix_stage_plugin.lab.embedded.trainer_main",
      description="Serve the embedded JAX trainer over gRPC on 127.0.0.1 until SIGTERM/SIGINT.")
  parser.add_argument("--port", type=_port, required=True,
                      help="TCP port on 127.0.0.1 (0: any free port, named in the READY line)")
  flags_lib.add_argparse_flags(parser, flags_lib.TRAINER_FIELDS)
  parser.add_argument("--fail_stage_ids", default="", metavar="IDS",
                      help="testing: comma-separated micro-batch ids (e.g. s1-m2) whose stage "
                      "fails in the worker, to exercise the inline fallback")
  parser.add_argument("--shutdown_grace_s", type=_non_negative, default=2.0, metavar="S",
                      help="on SIGTERM/SIGINT, how long calls already running may take to finish "
                      "before the process exits anyway (exit code 3; default 2)")
  parser.add_argument("--max_call_mib", type=_mib,
                      default=server_lib.DEFAULT_MAX_CALL_BYTES >> 20, metavar="MIB",
                      help="refuse a large call whose header announces more than this "
                      f"(default {server_lib.DEFAULT_MAX_CALL_BYTES >> 20})")
  parser.add_argument("--exit_with_parent", choices=PARENT_WATCHES, default="off",
                      help="stop when the process that started this one dies: 'pipe' watches "
                      "stdin (a pipe from the parent) for end-of-file, 'signal' asks Linux for a "
                      "SIGTERM when the parent thread exits (prctl PR_SET_PDEATHSIG), 'both' "
                      "(what TrainerProcess passes); default off")
  parser.add_argument("--log_level", default="WARNING",
                      choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="stderr log level")
  return parser


def _exit_now(signum: int, _: Any) -> None:
  """A second SIGTERM/SIGINT while stopping: exit at once, whatever is still running."""
  os.write(2, f"trainer WARNING second {signal.Signals(signum).name} while stopping: exiting "
              f"now ({128 + signum})\n".encode())
  os._exit(128 + signum)


def _ask_for_parent_death_signal() -> None:
  """SIGTERM this process when its parent thread exits (Linux; a no-op elsewhere, logged)."""
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    failed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0
  except (OSError, AttributeError):
    failed = True
  if failed:
    log.warning("--exit_with_parent: prctl(PR_SET_PDEATHSIG) is not available here; "
                "only the stdin pipe (pipe, both) notices the parent's death")


def _check_stdin_is_a_pipe() -> None:
  mode = os.fstat(0).st_mode
  if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
    raise ValueError("--exit_with_parent pipe/both: stdin must be a pipe from the parent process "
                     "(TrainerProcess makes one); it is not")


def _watch_stdin(loop: asyncio.AbstractEventLoop, stop: Callable[[str], None]) -> None:
  """Stops the trainer when stdin reaches end-of-file: the parent holding its other end is gone."""
  def readable() -> None:
    try:
      data = os.read(0, 1 << 16)
    except OSError:
      data = b""
    if not data:  # the parent never writes; anything it does write is ignored
      loop.remove_reader(0)
      stop("its parent went away (stdin closed)")

  loop.add_reader(0, readable)


async def serve(port: int, cfg: config_lib.StageConfig, fail_stage: frozenset[str], *,
                shutdown_grace_s: float = 2.0,
                max_call_bytes: int = server_lib.DEFAULT_MAX_CALL_BYTES,
                watch_stdin: bool = False) -> None:
  """Serves until a stop signal; exits the process (EXIT_ABANDONED) if calls outlast the grace."""
  worker = worker_lib.TrainerWorker(cfg, fail_stage=fail_stage)
  executor = worker_lib.make_executor(cfg)
  server = server_lib.WorkerServer(worker, executor, timeline=worker.recorder,
                                   max_call_bytes=max_call_bytes, pool=worker.pool)
  stopping = asyncio.Event()
  loop = asyncio.get_running_loop()

  def stop(reason: str, level: int = logging.WARNING) -> None:
    if not stopping.is_set():
      log.log(level, "stopping: %s; calls already running get %g s to finish", reason,
              shutdown_grace_s)
      stopping.set()

  def on_signal(sig: signal.Signals) -> None:
    # The next signal exits at once, even while this thread waits for the lanes. Only signals
    # count: a parent's death is noticed twice (stdin closes, PR_SET_PDEATHSIG) and is one stop.
    # In place before the stop is logged: a signal sent once the log says "stopping" exits (sent
    # between the line and the handlers, it reached the loop's handler just removed and was lost).
    for s in STOP_SIGNALS:
      loop.remove_signal_handler(s)
      signal.signal(s, _exit_now)
    stop(f"{sig.name} received", logging.INFO)  # the usual way to stop: not a warning

  for sig in STOP_SIGNALS:
    loop.add_signal_handler(sig, on_signal, sig)
  if watch_stdin:
    _watch_stdin(loop, stop)
  try:
    bound = await server.start(port)
    print(f"READY {server_lib.BIND_HOST}:{bound}", flush=True)
    log.info("serving on %s:%d (%s)", server_lib.BIND_HOST, bound, cfg.as_dict())
    await stopping.wait()
  finally:
    deadline = loop.time() + shutdown_grace_s
    # Refuses new calls at once and waits for the running ones. Calls still on a lane at the
    # grace are not cancelled through grpc (it prints each as a crash): the process exits under
    # them. grpc's own grace, a second longer, only ends a call that was not on a lane.
    stopped = asyncio.ensure_future(server.stop(grace=shutdown_grace_s + 1.0))
    await asyncio.wait({stopped}, timeout=shutdown_grace_s)
    busy = executor.close(timeout=max(0.0, deadline - loop.time()))
    worker.close()
    if busy:
      _abandon([lane.value for lane in busy], shutdown_grace_s)
    await stopped


def _abandon(lanes: list[str], grace_s: float) -> None:
  """Exits now, leaving the calls still running on `lanes` (they may sit in native code)."""
  log.warning("abandoned the calls still running on the %s lane(s) after the %g s shutdown "
              "grace; exiting %d", ", ".join(lanes), grace_s, EXIT_ABANDONED)
  logging.shutdown()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(EXIT_ABANDONED)


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
    if args.exit_with_parent in ("pipe", "both"):
      _check_stdin_is_a_pipe()
  except ValueError as e:
    print(f"trainer_main: error: {e}", file=sys.stderr)
    return 2
  if args.exit_with_parent in ("signal", "both"):
    _ask_for_parent_death_signal()
  try:
    asyncio.run(serve(args.port, cfg, fail_stage, shutdown_grace_s=args.shutdown_grace_s,
                      max_call_bytes=args.max_call_mib << 20,
                      watch_stdin=args.exit_with_parent in ("pipe", "both")))
  except OSError as e:
    print(f"trainer_main: error: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
