"""One flag spelling across `tunix-stage`, the process entry points and the recipes.

Underscores are canonical (as the hosts' drivers spell their flags); the dashed spelling parses
to the same option. Real parsers, real console script.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from tunix_stage_plugin.cli import main as cli_main
from tunix_stage_plugin.lab.embedded import orchestrator_main
from tunix_stage_plugin.lab.embedded import trainer_main


def _parsers() -> dict[str, argparse.ArgumentParser]:
  top = cli_main.build_parser()
  found = {"tunix-stage": top}
  for action in top._actions:  # the subparsers action: argparse offers no public accessor
    if isinstance(action, argparse._SubParsersAction):
      found.update({f"tunix-stage {name}": p for name, p in action.choices.items()})
  found["trainer_main"] = trainer_main.build_parser()
  found["orchestrator_main"] = orchestrator_main.build_parser()
  return found


@pytest.mark.parametrize("name,parser", sorted(_parsers().items()))
def test_every_long_flag_is_spelled_with_underscores(name: str, parser: argparse.ArgumentParser):
  longs = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
  assert longs, name
  assert [o for o in longs if "-" in o[2:]] == [], f"{name} spells a flag with a dash"


@pytest.mark.parametrize("argv", [
    ["bench", "--payload_mib", "8", "--stage_max_device_batches", "2"],
    ["bench", "--payload-mib", "8", "--stage-max-device-batches", "2"],
    ["bench", "--payload-mib=8", "--stage-max-device-batches=2"],
])
def test_dashed_spellings_parse_to_the_same_options(argv: list[str]):
  args, unknown = cli_main.build_parser().parse_known_args(argv)
  assert unknown == []
  assert (args.payload_mib, args.max_device_batches) == ("8", "2")


def test_the_trainer_entry_point_takes_the_dashed_device_bound():
  parser = trainer_main.build_parser()
  new = parser.parse_args(["--port", "0", "--stage_max_device_batches", "3"])
  dashed = parser.parse_args(["--port", "0", "--stage-max-device-batches", "3"])
  assert vars(new) == vars(dashed)
  assert new.stage_max_device_batches == "3"


def test_a_command_given_to_run_keeps_its_flags_as_written():
  args, unknown = cli_main.build_parser().parse_known_args(
      ["run", "--dry-run", "--", "python", "job.py", "--dry-run", "--max-device-batches=1"])
  assert unknown == []
  assert args.dry_run is True
  assert args.command == ["--", "python", "job.py", "--dry-run", "--max-device-batches=1"]


def test_an_unknown_flag_is_reported_by_the_subcommand_that_got_it():
  proc = subprocess.run([sys.executable, "-m", "tunix_stage_plugin.cli.main", "simulate", "x.json",
                         "--no_such_flag"], capture_output=True, text=True, timeout=60)
  assert proc.returncode == 2
  assert "tunix-stage simulate: error: unrecognized arguments: --no_such_flag" in proc.stderr
  assert "usage: tunix-stage simulate" in proc.stderr


# A staging flag's value that begins with '-' is the flag's value in either spelling, so the
# setting's own check judges it (argparse alone says "expected one argument"); a word after a bare
# --stage_train_batches is the next option, and nothing after a bare `--` is touched.
JOINED = [
    (["config", "--stage_memory_budget", "-1GiB"], {"stage_memory_budget": "-1GiB"}),
    (["config", "--stage-memory-budget", "-1GiB"], {"stage_memory_budget": "-1GiB"}),
    (["config", "--stage_memory", "-1GiB"], {"stage_memory_budget": "-1GiB"}),  # abbreviated
    (["config", "--stage_metrics", "-x", "--max_staged_batches", "-2"],
     {"stage_metrics": "-x", "max_staged_batches": "-2"}),
    (["bench", "--stage_codec", "-on", "--stage_max_host_batches", "-1"],
     {"stage_codec": "-on", "max_host_batches": "-1"}),
    (["run", "--stage_log_every", "-5", "--", "job", "--stage_log_every", "-5"],
     {"stage_log_every": "-5", "command": ["--", "job", "--stage_log_every", "-5"]}),
]


@pytest.mark.parametrize("argv, expected", JOINED, ids=[" ".join(a) for a, _ in JOINED])
def test_a_staging_value_that_begins_with_a_dash_reaches_its_flag(argv, expected):
  args = cli_main.build_parser().parse_args(argv)
  assert {name: getattr(args, name) for name in expected} == expected


def test_a_word_after_a_bare_stage_train_batches_is_the_next_option():
  args, unknown = cli_main.build_parser().parse_known_args(
      ["config", "--stage_train_batches", "--max_staged_batches", "-3"])
  assert (args.stage_train_batches, args.max_staged_batches, unknown) == ("stage", "-3", [])


def test_a_driver_s_own_parser_joins_a_staging_value_too():
  from tunix_stage_plugin.core import flags as flags_lib  # pylint: disable=import-outside-toplevel
  parser = argparse.ArgumentParser(prog="driver")
  parser.add_argument("--model_id")
  flags_lib.add_argparse_flags(parser)
  args = parser.parse_args(["--model_id", "m", "--stage_memory_budget", "-1GiB"])
  assert (args.model_id, args.stage_memory_budget) == ("m", "-1GiB")
  from tunix_stage_plugin.core import config as config_lib  # pylint: disable=import-outside-toplevel
  with pytest.raises(config_lib.ConfigError) as e:
    flags_lib.config_from_argparse(args)
  assert str(e.value).startswith("--stage_memory_budget='-1GiB' is invalid; accepted: a size")
