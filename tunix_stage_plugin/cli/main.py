"""`tunix-stage`: one console script, a subcommand per job (docs/bench.md, docs/configuration.md,
docs/simulate.md, docs/observability.md, docs/tunix.md "Doctor").

The reading layer's and the lab's subcommands (LAZY_COMMANDS) are imported only when run (their
--help included), so a production command never loads them, nor their libraries
(tests/test_layout.py runs them with the lab and the reading layer blocked). A
subcommand's own options may never reuse a name the top-level parser owns in the namespace
(SUBCOMMAND_DEST and its defaults): a subcommand's values overwrite the top level's (`run`'s
COMMAND would replace the subcommand's name), so build_parser refuses such a clash.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Iterable

from tunix_stage_plugin import __version__
from tunix_stage_plugin.cli import config_cmd
from tunix_stage_plugin.cli import doctor_cmd
from tunix_stage_plugin.cli import run_cmd
from tunix_stage_plugin.core import flags as flags_lib
from tunix_stage_plugin.core import install_hint

# Each subcommand module offers add_parser(subparsers) and run(args) -> exit code.
_COMMANDS = (config_cmd, doctor_cmd, run_cmd)
# The subcommands imported only when run: name -> (module, the one line `tunix-stage --help`
# shows, the package's extra that installs the libraries it needs). Such a module offers
# add_parser(subparsers, help) and run(args).
LAZY_COMMANDS = {
    "report": ("tunix_stage_plugin.reading.report",
               "what staging did in a job, from its metrics records (TUNIX_STAGE_METRICS)",
               "report"),
    "bench": ("tunix_stage_plugin.lab.bench.command",
              "run the staging A/B (inline, depth1, depth2, depth2_prestage, resident) on the "
              "embedded host or tunix's", "bench"),
    "simulate": ("tunix_stage_plugin.lab.sim.command",
                 "predict what staging saves on a job from its recorded per-micro-batch times",
                 "bench"),
}

SUBCOMMAND_DEST = "subcommand"  # the subcommand's name in the parsed namespace
RESERVED = (SUBCOMMAND_DEST, "subcommands", "run")  # names the top level sets or reads


def build_parser(lab: Iterable[str] = tuple(LAZY_COMMANDS)) -> argparse.ArgumentParser:
  """The whole parser; the lazy subcommands named in `lab` with their own parsers (their modules
  imported), the others by name and help only."""
  parser = flags_lib.Parser(
      prog="tunix-stage",
      description="Micro-batch staging for google/tunix's distributed RL trainer.",
  )
  parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
  subparsers = parser.add_subparsers(dest=SUBCOMMAND_DEST, metavar="COMMAND", required=True)
  for module in _COMMANDS:
    module.add_parser(subparsers)
  lab = set(lab)
  for name, (module, help_line, _) in LAZY_COMMANDS.items():
    if name in lab:
      importlib.import_module(module).add_parser(subparsers, help_line)
    else:
      subparsers.add_parser(name, help=help_line, add_help=False)
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


def _chosen(argv: list[str]) -> str | None:
  """The subcommand argv runs: its first word that is not an option (the top level's options,
  --help and --version, take no value)."""
  return next((word for word in argv if not word.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  try:
    return _main(argv)
  except KeyboardInterrupt:  # a command that handles none of its own (SIGINT: 128 + 2)
    chosen = _chosen(argv)
    print(f"tunix-stage{' ' + chosen if chosen else ''}: interrupted by SIGINT", file=sys.stderr)
    return 130


def _main(argv: list[str]) -> int:
  chosen = _chosen(argv)
  try:
    parser = build_parser(lab=[chosen] if chosen in LAZY_COMMANDS else [])
  except ModuleNotFoundError as e:
    if chosen not in LAZY_COMMANDS or (e.name or "").startswith("tunix_stage_plugin"):
      raise
    extra = LAZY_COMMANDS[chosen][2]
    print(f"tunix-stage {chosen}: error: it needs the Python package {e.name}, which is not "
          f"installed; install the '{extra}' extra: {install_hint.install_command(extra)}",
          file=sys.stderr)
    return 2
  args, unknown = parser.parse_known_args(argv)
  if unknown:  # the subcommand that owns the flags reports them, with its own usage line
    args.subcommands[getattr(args, SUBCOMMAND_DEST)].error(
        f"unrecognized arguments: {' '.join(unknown)}")
  try:
    code = args.run(args)
    sys.stdout.flush()
  except BrokenPipeError:
    # The reader went away (`tunix-stage config --json | head -1`): the rest has nowhere to go.
    # Python's own advice: point stdout at /dev/null so the exit flush cannot fail again.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1
  return code


if __name__ == "__main__":
  sys.exit(main())
