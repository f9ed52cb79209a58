"""`tunix-stage run -- <command>`: run a command with staging switched on through the bootstrap.

The command's Python processes (and their children, by inheritance) pick staging up from the
environment through the .pth bootstrap, so this sets the environment and execs; a command that
cannot be run exits as a shell's would (127, 126). docs/tunix.md "Activation, three ways".
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys

from tunix_stage_plugin.activation import bootstrap
from tunix_stage_plugin.cli import config_cmd
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import flags as flags_lib
from tunix_stage_plugin.core import inputs
from tunix_stage_plugin.core import install_hint


def add_parser(subparsers: argparse._SubParsersAction) -> None:
  parser = subparsers.add_parser(
      "run",
      help="run a command with staging on (sets the env, then execs)",
      description="Run COMMAND with staging switched on through the env-gated bootstrap: sets "
      "TUNIX_STAGE_BATCH=stage (unless a mode is given by flag or environment) and the depth "
      "variables given as flags, then replaces this process with COMMAND.",
      epilog="example: tunix-stage run --max_staged_batches 2 -- python -m "
      "tunix.experimental.distributed.runtime.main --process_main=...",
  )
  flags_lib.add_argparse_flags(parser)
  parser.add_argument("--dry_run", action="store_true",
                      help="print the environment changes and the command instead of running it")
  parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
  parser.set_defaults(run=run)


def child_environment(args: argparse.Namespace, environ: dict[str, str]) -> dict[str, str]:
  """The variables to set for the command (only those that differ from `environ`)."""
  cfg = config_lib.resolve(
      {f: getattr(args, config_lib.SETTINGS_BY_FIELD[f].flag) for f in flags_lib.ALL_FIELDS},
      env=environ, explicit_source="flag")
  changes = {}
  for setting in config_lib.SETTINGS:
    source = cfg.sources[setting.field]
    if setting.field == "mode" and source == config_lib.SOURCE_DEFAULT:
      changes[setting.env] = config_lib.MODE_STAGE  # the point of `run`: on unless told off
    elif source == "flag":
      changes[setting.env] = str(getattr(cfg, setting.field))
  return {k: v for k, v in changes.items() if environ.get(k) != v}


# The shell's exit statuses for a command that could not be run (POSIX, "Command Search and
# Execution"): found but not executable, and not found.
EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127


def run(args: argparse.Namespace) -> int:
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  problems = [] if command else [inputs.invalid(
      "COMMAND", None, "tunix-stage run [flags] -- COMMAND [ARGS ...]", "none given")]
  try:
    changes = child_environment(args, dict(os.environ))
  except config_lib.ConfigError as e:
    problems = e.problems + problems
  if problems:
    return config_cmd.print_config_error("run", config_lib.ConfigError(*problems))
  if not bootstrap.installed_pth_files():
    print(f"tunix-stage run: warning: {bootstrap.PTH_NAME} is not in this interpreter's "
          "site-packages, so Python children will not activate; reinstall the package "
          f"({install_hint.install_command()}) or call tunix_stage_plugin.install()",
          file=sys.stderr)
  if args.dry_run:
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(changes.items()))
    print(f"{assignments} {shlex.join(command)}".strip())
    return 0
  env = {**os.environ, **changes}
  # Python ignores SIGPIPE, and an ignored signal stays ignored across exec: the command gets the
  # default back, as a shell would start it.
  previous = signal.signal(signal.SIGPIPE, signal.SIG_DFL)
  try:
    os.execvpe(command[0], command, env)
  except OSError as e:
    print(f"tunix-stage run: error: cannot run {command[0]!r}: {e.strerror or e}",
          file=sys.stderr)
    return EXIT_NOT_FOUND if isinstance(e, FileNotFoundError) else EXIT_CANNOT_EXECUTE
  finally:  # reached only when exec failed
    signal.signal(signal.SIGPIPE, previous)
  return 0  # not reached: exec replaced this process
