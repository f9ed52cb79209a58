"""Every subcommand's `--help`, `-h` and an unknown flag, through the real console entry point.

The subcommands come from the CLI's own table (`cli.main.subcommands()`), so a new one is covered
without touching this file. Each runs in its own process, as a user would run it: help exits 0,
an unknown flag exits 2 with one `tunix-stage NAME: error: unrecognized arguments: ...` line and
NAME's usage line, and neither prints a traceback. (`simulate --help` once died on a bare `%`
in a help string; `run --bogus -- true` on `run`'s positional overwriting the subcommand's name.)
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from tunix_stage_plugin.cli import main as cli_main
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.lab.embedded import orchestrator_main
from tunix_stage_plugin.lab.embedded import trainer_main

SUBCOMMANDS = sorted(cli_main.subcommands())
UNKNOWN = "--no_such_flag_xyz"


def tunix_stage(*argv: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "tunix_stage_plugin.cli.main", *argv],
                        capture_output=True, text=True, timeout=120, check=False)


def required_arguments(parser: argparse.ArgumentParser) -> list[str]:
  """Placeholders for the positionals `parser` requires, so only the unknown flag is wrong."""
  words = []
  for action in parser._actions:  # pylint: disable=protected-access
    if action.option_strings:
      continue
    if action.nargs == argparse.REMAINDER:
      words += ["--", "true"]
    elif action.nargs in (None, 1, argparse.ONE_OR_MORE):
      words.append("placeholder")
  return words


def test_the_table_lists_every_subcommand_module():
  assert SUBCOMMANDS == sorted(["bench", "config", "doctor", "report", "run", "simulate"])


@pytest.mark.parametrize("name", SUBCOMMANDS)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_exits_0_without_a_traceback(name: str, flag: str):
  proc = tunix_stage(name, flag)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "Traceback" not in proc.stdout + proc.stderr
  assert proc.stdout.startswith(f"usage: tunix-stage {name}")


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_an_unknown_flag_is_reported_by_that_subcommand(name: str):
  proc = tunix_stage(name, UNKNOWN, *required_arguments(cli_main.subcommands()[name]))
  assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
  assert "Traceback" not in proc.stdout + proc.stderr
  assert proc.stderr.startswith(f"usage: tunix-stage {name}"), proc.stderr
  assert proc.stderr.splitlines()[-1] == (
      f"tunix-stage {name}: error: unrecognized arguments: {UNKNOWN}")


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_a_staging_flag_shows_its_setting_s_metavar(name: str):
  """config, doctor and run take the staging flags: `--stage_codec CODEC`, not `N`."""
  parser = cli_main.subcommands()[name]
  for setting in config_lib.SETTINGS:
    actions = [a for a in parser._actions  # pylint: disable=protected-access
               if f"--{setting.flag}" in a.option_strings]
    assert all(a.metavar == setting.metavar for a in actions), (setting.flag, actions)
  if name in ("config", "doctor", "run"):
    assert "[--stage_codec CODEC]" in " ".join(parser.format_usage().split())


@pytest.mark.parametrize("name", ["config", "doctor", "run"])
def test_an_unset_default_shows_as_none_in_help(name: str):
  """A setting whose default is unset (a folder, a fingerprint) shows `default none.`, never
  `default .` (which reads as the current folder)."""
  text = " ".join(cli_main.subcommands()[name].format_help().split())
  assert "default ." not in text
  for setting in config_lib.SETTINGS:
    default = setting.default_note or config_lib.shown(setting.default)  # a machine's: in words
    assert f"Overrides ${setting.env}; default {default}." in text
  assert "Overrides $TUNIX_STAGE_METRICS; default none." in text


def test_the_settings_table_shows_an_unset_value_as_none():
  for name in ("config", "doctor"):
    rows = [line.split() for line in tunix_stage(name).stdout.splitlines()]
    assert ["TUNIX_STAGE_METRICS", "none", "(default)"] in [r[-3:] for r in rows if r], name


def test_simulate_s_help_names_every_input_it_reads():
  text = " ".join(cli_main.subcommands()["simulate"].format_help().split())
  for kind in ("a trace JSON or CSV", "a bench JSON", "trace.json", "metrics record",
               "TUNIX_STAGE_METRICS"):
    assert kind in text, kind


def test_the_issue_s_run_case():
  proc = tunix_stage("run", "--bogus", "--", "true")
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
  assert proc.stderr.splitlines()[-1] == "tunix-stage run: error: unrecognized arguments: --bogus"


@pytest.mark.parametrize("parser", [orchestrator_main.build_parser(), trainer_main.build_parser(),
                                    cli_main.build_parser(), *cli_main.subcommands().values()],
                         ids=lambda p: p.prog)
def test_every_parser_formats_its_help(parser: argparse.ArgumentParser):
  # In process, for the entry points too: a bare % in any help string raises here.
  assert parser.format_help().startswith("usage: ")


def test_a_subcommand_option_that_reuses_a_reserved_name_is_refused_when_the_parser_is_made(
    monkeypatch):
  def add_parser(subparsers):
    sub = subparsers.add_parser("clash")
    sub.add_argument(cli_main.SUBCOMMAND_DEST, nargs=argparse.REMAINDER)

  module = type(sys)("clash_cmd")
  module.add_parser = add_parser
  monkeypatch.setattr(cli_main, "_COMMANDS", (*cli_main._COMMANDS, module))
  with pytest.raises(RuntimeError, match="tunix-stage clash: .*'subcommand'.* is reserved"):
    cli_main.build_parser()
