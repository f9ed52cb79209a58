"""`tunix-stage`: one console script, a subcommand per job."""

from __future__ import annotations

import argparse
import sys

from tunix_stage_plugin import __version__
from tunix_stage_plugin.cli import bench_cmd
from tunix_stage_plugin.cli import config_cmd
from tunix_stage_plugin.cli import doctor_cmd
from tunix_stage_plugin.cli import run_cmd
from tunix_stage_plugin.cli import simulate_cmd
from tunix_stage_plugin.core import flags as flags_lib

# Each subcommand module offers add_parser(subparsers) and run(args) -> exit code.
_COMMANDS = (config_cmd, doctor_cmd, run_cmd, bench_cmd, simulate_cmd)


def build_parser() -> argparse.ArgumentParser:
  parser = flags_lib.Parser(
      prog="tunix-stage",
      description="Micro-batch staging for google/tunix's distributed RL trainer.",
  )
  parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
  subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
  for module in _COMMANDS:
    module.add_parser(subparsers)
  parser.set_defaults(subcommands=subparsers.choices)
  return parser


def main(argv: list[str] | None = None) -> int:
  parser = build_parser()
  args, unknown = parser.parse_known_args(argv)
  if unknown:  # the subcommand that owns the flags reports them, with its own usage line
    args.subcommands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
  return args.run(args)


if __name__ == "__main__":
  sys.exit(main())
