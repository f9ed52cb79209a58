"""`tunix-stage`: one console script, a subcommand per job (docs/bench.md,
docs/configuration.md, docs/simulate.md, docs/tunix.md "Doctor").

The top-level parser owns a few names in the parsed namespace (SUBCOMMAND_DEST and the keys it
sets as defaults); a subcommand's own options and positionals may never reuse them, since a
subcommand's values overwrite the top level's (`run`'s positional COMMAND would replace the
subcommand's name). build_parser refuses such a clash when the parser is made.
"""

from __future__ import annotations

import argparse
import sys

import importlib

from tunix_stage_plugin import __version__
from tunix_stage_plugin.cli import config_cmd
from tunix_stage_plugin.cli import doctor_cmd
from tunix_stage_plugin.cli import report_cmd
from tunix_stage_plugin.cli import run_cmd
from tunix_stage_plugin.core import flags as flags_lib

# Each subcommand module offers add_parser(subparsers) and run(args) -> exit code.
_COMMANDS = (config_cmd, doctor_cmd, run_cmd, report_cmd)
# The lab's commands (bench, simulate), imported only to build the parser: the production
# commands above never load the lab (tunix_stage_plugin.lab).
_LAB_COMMANDS = ("tunix_stage_plugin.lab.bench.command", "tunix_stage_plugin.lab.sim.command")

SUBCOMMAND_DEST = "subcommand"  # the subcommand's name in the parsed namespace
RESERVED = (SUBCOMMAND_DEST, "subcommands", "run")  # names the top level sets or reads


def build_parser() -> argparse.ArgumentParser:
  parser = flags_lib.Parser(
      prog="tunix-stage",
      description="Micro-batch staging for google/tunix's distributed RL trainer.",
  )
  parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
  subparsers = parser.add_subparsers(dest=SUBCOMMAND_DEST, metavar="COMMAND", required=True)
  for module in (*_COMMANDS, *map(importlib.import_module, _LAB_COMMANDS)):
    module.add_parser(subparsers)
  for name, subparser in subparsers.choices.items():
    # pylint: disable-next=protected-access  (argparse offers no public list of a parser's actions)
    clash = sorted({a.dest for a in subparser._actions} & set(RESERVED))
    if clash:
      raise RuntimeError(f"tunix-stage {name}: option or argument dest {clash} is reserved by "
                         f"the top-level parser ({', '.join(RESERVED)}); give it another dest")
  parser.set_defaults(subcommands=subparsers.choices)
  return parser


def subcommands() -> dict[str, argparse.ArgumentParser]:
  """Every subcommand's parser, by name (the table `tunix-stage --help` lists)."""
  return dict(build_parser().get_default("subcommands"))


def main(argv: list[str] | None = None) -> int:
  parser = build_parser()
  args, unknown = parser.parse_known_args(argv)
  if unknown:  # the subcommand that owns the flags reports them, with its own usage line
    args.subcommands[getattr(args, SUBCOMMAND_DEST)].error(
        f"unrecognized arguments: {' '.join(unknown)}")
  return args.run(args)


if __name__ == "__main__":
  sys.exit(main())
