"""`tunix-stage run -- <command>`: run a command with staging switched on through the bootstrap.

The command's Python processes pick staging up from the environment through the package's .pth
bootstrap, so this sets the environment and execs: TUNIX_STAGE_BATCH=stage unless a mode is given
(a flag here, else TUNIX_STAGE_BATCH already in the environment), and TUNIX_MAX_STAGED_BATCHES /
TUNIX_STAGE_MAX_DEVICE_BATCHES from the flags when given (flags beat env). Children of the
command inherit the environment, so every process of a multi-process launch is covered.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from tunix_stage_plugin.activation import bootstrap
from tunix_stage_plugin.cli import config_cmd
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import flags as flags_lib


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


def run(args: argparse.Namespace) -> int:
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    print("tunix-stage run: error: no command given (usage: tunix-stage run [flags] -- COMMAND)",
          file=sys.stderr)
    return 2
  try:
    changes = child_environment(args, dict(os.environ))
  except config_lib.ConfigError as e:
    return config_cmd.print_config_error("run", e)
  if not bootstrap.installed_pth_files():
    print(f"tunix-stage run: warning: {bootstrap.PTH_NAME} is not in this interpreter's "
          "site-packages, so Python children will not activate; reinstall the package "
          "(pip install tunix-stage-plugin) or call tunix_stage_plugin.install()", file=sys.stderr)
  if args.dry_run:
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(changes.items()))
    print(f"{assignments} {shlex.join(command)}".strip())
    return 0
  env = {**os.environ, **changes}
  try:
    os.execvpe(command[0], command, env)
  except OSError as e:
    print(f"tunix-stage run: error: cannot run {command[0]!r}: {e}", file=sys.stderr)
    return 127
  return 0  # not reached: exec replaced this process
