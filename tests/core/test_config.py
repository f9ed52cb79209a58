"""Configuration: explicit > env > default, and one clear error per bad value."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import flags as flags_lib
from tunix_stage_plugin.core import install_hint

ENV_NAMES = [s.env for s in config_lib.SETTINGS]


def test_defaults_when_env_is_empty():
  cfg = config_lib.resolve(env={})
  assert (cfg.mode, cfg.max_staged_batches, cfg.max_device_batches) == ("off", "auto", 1)
  assert cfg.max_host_batches == "auto"  # both sized each step by default, from their fixed values
  assert [config_lib.fixed(f, getattr(cfg, f)) for f in ("max_staged_batches",
                                                         "max_host_batches")] == [2, 1]
  assert not cfg.enabled
  assert set(cfg.sources.values()) == {"default"}


def test_env_beats_default_and_explicit_beats_env():
  env = {"TUNIX_STAGE_BATCH": "stage", "TUNIX_MAX_STAGED_BATCHES": "3",
         "TUNIX_STAGE_MAX_DEVICE_BATCHES": "2", "TUNIX_STAGE_MAX_HOST_BATCHES": "4",
         "TUNIX_STAGE_CODEC": "off", "TUNIX_STAGE_ACCEPT_TRAIN_STAGE": "0123456789abcdef",
         "TUNIX_STAGE_METRICS": "/tmp/job-metrics", "TUNIX_STAGE_LOG_EVERY": "10",
         "TUNIX_STAGE_MEMORY_BUDGET": "6GiB"}
  cfg = config_lib.resolve(env=env)
  assert (cfg.mode, cfg.max_staged_batches, cfg.max_device_batches, cfg.max_host_batches,
          cfg.metrics, cfg.log_every) == ("stage", 3, 2, 4, "/tmp/job-metrics", 10)
  assert cfg.enabled and set(cfg.sources.values()) == {"env"}
  cfg = config_lib.resolve({"max_staged_batches": 1, "mode": None}, env=env,
                           explicit_source="flag")
  assert cfg.max_staged_batches == 1 and cfg.sources["max_staged_batches"] == "flag"
  assert cfg.mode == "stage" and cfg.sources["mode"] == "env"  # None means "not given"


def test_empty_env_value_counts_as_unset_and_whitespace_alone_is_refused():
  cfg = config_lib.resolve(env={"TUNIX_STAGE_BATCH": "", "TUNIX_MAX_STAGED_BATCHES": ""})
  assert cfg.mode == "off" and cfg.max_staged_batches == "auto"
  with pytest.raises(config_lib.ConfigError) as e:  # not `unset`: judged, as every value
    config_lib.resolve(env={"TUNIX_STAGE_BATCH": "  "})
  assert e.value.problems == [
      "TUNIX_STAGE_BATCH='  ' is invalid: it begins with a space, and no setting's value may "
      "begin or end with whitespace (none is trimmed); accepted: off | stage"]


@pytest.mark.parametrize("name,value,accepted", [
    ("TUNIX_STAGE_BATCH", "on", "off | stage"),
    ("TUNIX_STAGE_BATCH", "STAGE", "off | stage"),
    ("TUNIX_MAX_STAGED_BATCHES", "0", "integer >= 1"),
    ("TUNIX_MAX_STAGED_BATCHES", "-1", "integer >= 1"),
    ("TUNIX_MAX_STAGED_BATCHES", "2.5", "integer >= 1"),
    ("TUNIX_MAX_STAGED_BATCHES", "+2", "integer >= 1"),
    ("TUNIX_STAGE_MAX_DEVICE_BATCHES", "two", "integer >= 1"),
    ("TUNIX_STAGE_MAX_DEVICE_BATCHES", "1025", "integer >= 1 and <= 1024"),
    ("TUNIX_MAX_STAGED_BATCHES", "99999999999999999999", "integer >= 1 and <= 1024"),
])
def test_invalid_env_value_names_variable_value_and_accepted(name, value, accepted):
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.resolve(env={name: value})
  message = str(e.value)
  assert name in message and repr(value) in message and accepted in message


def test_upper_bound_is_accepted():
  assert config_lib.resolve(env={"TUNIX_MAX_STAGED_BATCHES": "1024"}).max_staged_batches == 1024


@pytest.mark.parametrize("name", ["TUNIX_MAX_STAGED_BATCHES", "TUNIX_STAGE_BATCH"])
def test_a_huge_value_is_refused_with_a_short_echo(name):
  value = "9" * 4300  # past Python's own int-digit limit: its message must not leak
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.resolve(env={name: value})
  accepted = ("off | stage" if name == "TUNIX_STAGE_BATCH"
              else "auto, or an integer >= 1 and <= 1024")
  assert str(e.value) == (f"{name}='{'9' * 32}'... (4300 characters) is invalid: longer than 64 "
                          f"characters; accepted: {accepted}")


def test_every_bad_setting_is_reported_at_once():
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.resolve({"max_device_batches": "0"}, env={
        "TUNIX_STAGE_BATCH": "on", "TUNIX_MAX_STAGED_BATCHES": "x" * 40,
        "TUNIX_STAGE_MAX_DEVICE_BATCHES": "2"})
  assert e.value.problems == [
      "TUNIX_STAGE_BATCH='on' is invalid; accepted: off | stage",
      f"TUNIX_MAX_STAGED_BATCHES='{'x' * 32}'... (40 characters) is invalid; accepted: auto, "
      "or an integer >= 1 and <= 1024",
      "--stage_max_device_batches='0' is invalid; accepted: an integer >= 1 and <= 1024"]
  assert str(e.value) == "; ".join(e.value.problems)


def test_invalid_explicit_value_names_the_flag():
  with pytest.raises(config_lib.ConfigError, match=r"--max_staged_batches='0' is invalid"):
    config_lib.resolve({"max_staged_batches": 0}, env={})


def test_bool_mode_maps_to_stage_or_off_but_bool_depth_is_rejected():
  assert config_lib.resolve({"mode": True}, env={}).mode == "stage"
  assert config_lib.resolve({"mode": False}, env={"TUNIX_STAGE_BATCH": "stage"}).mode == "off"
  with pytest.raises(config_lib.ConfigError, match="max_staged_batches"):
    config_lib.resolve({"max_staged_batches": True}, env={})


def test_unknown_setting_is_an_error():
  with pytest.raises(config_lib.ConfigError, match="unknown staging setting"):
    config_lib.resolve({"depth": 2}, env={})


def test_argparse_flags_beat_env(monkeypatch):
  monkeypatch.setenv("TUNIX_STAGE_BATCH", "off")
  monkeypatch.setenv("TUNIX_MAX_STAGED_BATCHES", "4")
  parser = flags_lib.add_argparse_flags(argparse.ArgumentParser())
  cfg = flags_lib.config_from_argparse(parser.parse_args(["--stage_train_batches"]))
  assert cfg.mode == "stage" and cfg.sources["mode"] == "flag"
  assert cfg.max_staged_batches == 4 and cfg.sources["max_staged_batches"] == "env"
  cfg = flags_lib.config_from_argparse(
      parser.parse_args(["--stage_train_batches=off", "--max_staged_batches", "1"]))
  assert (cfg.mode, cfg.max_staged_batches) == ("off", 1)


def test_roles_name_the_settings_each_process_reads():
  assert config_lib.fields_for("orchestrator") == ("mode", "max_staged_batches", "codec",
                                                   "accept_train_stage", "metrics", "log_every",
                                                   "memory_budget")
  assert config_lib.fields_for("trainer") == ("mode", "max_device_batches", "max_host_batches",
                                              "accept_train_stage", "metrics", "log_every",
                                              "memory_budget")
  assert flags_lib.TRAINER_FIELDS == config_lib.fields_for("trainer")
  with pytest.raises(ValueError, match="unknown role 'rollout'; accepted: orchestrator | trainer"):
    config_lib.fields_for("rollout")


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
  clean = {k: v for k, v in os.environ.items() if k not in ENV_NAMES}
  return subprocess.run([sys.executable, "-m", "tunix_stage_plugin.cli.main", *args],
                        env={**clean, **env}, capture_output=True, text=True, timeout=120)


def test_cli_config_exits_2_naming_the_variable():
  out = _cli("config", env={"TUNIX_MAX_STAGED_BATCHES": "0"})
  assert out.returncode == 2
  assert ("TUNIX_MAX_STAGED_BATCHES='0' is invalid; accepted: auto, or an integer >= 1"
          in out.stderr)
  assert out.stdout == ""


def test_cli_config_prints_one_line_per_bad_variable():
  out = _cli("config", "--check", env={"TUNIX_STAGE_BATCH": "on",
                                       "TUNIX_STAGE_MAX_DEVICE_BATCHES": "0"})
  assert out.returncode == 2 and out.stdout == ""
  assert out.stderr.splitlines() == [
      "tunix-stage config: error: TUNIX_STAGE_BATCH='on' is invalid; accepted: off | stage",
      "tunix-stage config: error: TUNIX_STAGE_MAX_DEVICE_BATCHES='0' is invalid; accepted: an "
      "integer >= 1 and <= 1024"]


def test_cli_config_json_reports_sources():
  out = _cli("config", "--json", "--max_staged_batches", "3", env={"TUNIX_STAGE_BATCH": "stage"})
  assert out.returncode == 0, out.stderr
  report = json.loads(out.stdout)
  assert report["enabled"] is True
  assert report["settings"]["mode"] == {"value": "stage", "source": "env",
                                        "env": "TUNIX_STAGE_BATCH"}
  assert report["settings"]["max_staged_batches"]["source"] == "flag"
  assert report["settings"]["max_device_batches"] == {
      "value": 1, "source": "default", "env": "TUNIX_STAGE_MAX_DEVICE_BATCHES"}


def test_cli_config_check_is_silent_when_valid():
  out = _cli("config", "--check", env={"TUNIX_STAGE_BATCH": "stage"})
  assert (out.returncode, out.stdout, out.stderr) == (0, "", "")


def test_codec_off_needs_no_codec_library():
  assert config_lib.resolve(env={"TUNIX_STAGE_CODEC": "off"}).codec == "off"
  assert config_lib.resolve(env={}).codec == "off"


@pytest.mark.parametrize("value", ["gzip", "zstd:99", "lz4:x", "blosc2-zstd:", "ZSTD"])
def test_a_bad_codec_is_one_line_with_what_is_accepted(value):
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.resolve(env={"TUNIX_STAGE_CODEC": value})
  (problem,) = e.value.problems
  assert problem.startswith(f"TUNIX_STAGE_CODEC={value!r} is invalid; accepted: off | on "
                            "(= blosc2-zstd:1) | NAME[:LEVEL] with LEVEL an integer in NAME's "
                            "range: ")


def test_a_bad_codec_level_names_every_codec_s_levels_from_the_codec_table():
  from tunix_stage_plugin.core import codec as codec_lib  # pylint: disable=import-outside-toplevel
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.resolve(env={"TUNIX_STAGE_CODEC": "blosc2-zstd:99"})
  (problem,) = e.value.problems
  for name, (low, high) in codec_lib.LEVELS.items():
    assert f"{name} {low} to {high} (default {codec_lib.DEFAULT_LEVELS[name]})" in problem
  assert "blosc2-zstd 0 to 9" in problem  # the table's own figures, as a user reads them


def test_the_settings_read_by_every_command_import_no_numpy():
  # What config accepts comes from codec_spec, which, unlike core/codec.py, needs no numpy.
  code = ("import sys; import tunix_stage_plugin.core.flags, tunix_stage_plugin.cli.main; "
          "print('numpy' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       check=True)
  assert out.stdout.strip() == "False"


@pytest.mark.parametrize("setting", config_lib.SETTINGS, ids=lambda s: s.field)
def test_each_flag_shows_its_setting_s_metavar(setting):
  parser = flags_lib.add_argparse_flags(argparse.ArgumentParser(prog="driver"))
  (action,) = [a for a in parser._actions if f"--{setting.flag}" in a.option_strings]
  assert action.metavar == setting.metavar


def test_the_codec_flag_is_shown_as_codec_not_as_a_count():
  usage = flags_lib.add_argparse_flags(argparse.ArgumentParser(prog="driver")).format_usage()
  assert "[--stage_codec CODEC]" in usage and "[--max_staged_batches N]" in usage


@pytest.mark.parametrize("value", ["blosc2-zstd", "blosc2-lz4:9", "blosc2-zstd:3", "on"])
def test_a_codec_is_accepted_where_installed_else_one_line_names_the_extra(value):
  from tunix_stage_plugin.core import codec as codec_lib  # pylint: disable=import-outside-toplevel
  if value == "on":
    value = "blosc2-zstd"  # what `on` means
  name = value.partition(":")[0]
  if codec_lib.installed(name):
    cfg = config_lib.resolve({"codec": value}, env={}, explicit_source="flag")
    assert cfg.codec == (value if ":" in value else f"{value}:{codec_lib.DEFAULT_LEVELS[name]}")
    assert cfg.sources["codec"] == "flag"
  else:
    with pytest.raises(config_lib.ConfigError) as e:
      config_lib.resolve({"codec": value}, env={}, explicit_source="flag")
    assert len(e.value.problems) == 1
    assert e.value.problems[0].startswith(f"--stage_codec={value!r} is invalid: codec {name} "
                                          "needs")
    assert e.value.problems[0].endswith(f"(the 'codec' extra: "
                                        f"{install_hint.install_command('codec')}); accepted: "
                                        f"{codec_lib.ACCEPTED}")


def test_a_missing_codec_library_is_named_with_the_extra(monkeypatch):
  """Where the codecs are installed, their absence cannot happen for real: `installed` is patched
  to say so (the real absence is what the test above checks without the extra)."""
  from tunix_stage_plugin.core import codec as codec_lib  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(codec_lib, "installed", lambda name: False)
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.resolve(env={"TUNIX_STAGE_CODEC": "blosc2-zstd:3", "TUNIX_STAGE_BATCH": "on"})
  assert e.value.problems == [
      "TUNIX_STAGE_BATCH='on' is invalid; accepted: off | stage",
      "TUNIX_STAGE_CODEC='blosc2-zstd:3' is invalid: codec blosc2-zstd needs the Python package "
      f"blosc2, which is not installed (the 'codec' extra: {install_hint.install_command('codec')}"
      f"); accepted: {codec_lib.ACCEPTED}"]


@pytest.mark.parametrize("value, expected", [("/tmp/m", "/tmp/m"), ("off", ""), ("", ""),
                                             ("/tmp/a b/c", "/tmp/a b/c")])
def test_the_metrics_folder_is_a_path_or_off(value, expected):
  assert config_lib.resolve(env={"TUNIX_STAGE_METRICS": value}).metrics == expected


def test_a_long_metrics_path_is_taken_and_a_bad_log_interval_is_refused():
  long_path = "/tmp/" + "d" * 300
  assert config_lib.resolve(env={"TUNIX_STAGE_METRICS": long_path}).metrics == long_path
  with pytest.raises(config_lib.ConfigError, match="TUNIX_STAGE_LOG_EVERY='-1' is invalid; "
                     "accepted: an integer >= 0 and <= 1000000"):
    config_lib.resolve(env={"TUNIX_STAGE_LOG_EVERY": "-1"})


@pytest.mark.parametrize("name", ["TUNIX_MAX_STAGED_BATCHES", "TUNIX_STAGE_MAX_HOST_BATCHES"])
def test_a_depth_or_host_bound_may_be_auto(name):
  cfg = config_lib.resolve(env={name: "auto"})
  field = config_lib.SETTINGS_BY_FIELD
  value = {s.env: getattr(cfg, f) for f, s in field.items()}[name]
  assert value == config_lib.AUTO and config_lib.is_auto(value)
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.resolve(env={name: "Auto"})
  assert str(e.value) == f"{name}='Auto' is invalid; accepted: auto, or an integer >= 1 and <= 1024"


def test_the_device_bound_is_never_auto():
  with pytest.raises(config_lib.ConfigError, match="accepted: an integer >= 1 and <= 1024"):
    config_lib.resolve(env={"TUNIX_STAGE_MAX_DEVICE_BATCHES": "auto"})


@pytest.mark.parametrize("text,value", [("6GiB", 6 << 30), ("512MiB", 512 << 20),
                                        ("1073741824", 1 << 30), ("2TiB", 2 << 40)])
def test_the_memory_budget_takes_a_size_with_a_unit(text, value):
  cfg = config_lib.resolve(env={"TUNIX_STAGE_MEMORY_BUDGET": text})
  assert cfg.memory_budget == value and cfg.sources["memory_budget"] == "env"
  assert str(cfg.memory_budget) == {6 << 30: "6GiB", 512 << 20: "512MiB", 1 << 30: "1GiB",
                                    2 << 40: "2TiB"}[value]


@pytest.mark.parametrize("text", ["6GB", "6 gib", "0", "1KiB", "-1GiB", "1.5GiB", "2048TiB",
                                  "10 GiB"])
def test_a_bad_memory_budget_is_one_line_naming_what_is_accepted(text):
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.resolve({"memory_budget": text}, env={})
  assert e.value.problems == [config_lib.inputs.invalid(
      "--stage_memory_budget", text, config_lib.BUDGET_ACCEPTED)]
  assert "MiB" in config_lib.BUDGET_ACCEPTED and "e.g. 6GiB" in config_lib.BUDGET_ACCEPTED


def test_the_memory_budget_defaults_to_a_quarter_of_the_machine():
  total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  cfg = config_lib.resolve(env={})
  assert total // 4 - (1 << 20) < cfg.memory_budget <= total // 4
  assert cfg.as_dict()["memory_budget"]["source"] == (
      "default: a quarter of this machine's physical memory")


def test_cli_config_and_env_for_show_the_budget_and_auto():
  out = _cli("config", env={"TUNIX_MAX_STAGED_BATCHES": "auto"})
  rows = {line.split()[0]: line for line in out.stdout.splitlines()}
  assert rows["TUNIX_MAX_STAGED_BATCHES"].split()[1:3] == ["auto", "(env:"]
  # Which is in force and from where: auto by default, sized from its fixed value, one setting
  # away; a fixed value says nothing more.
  assert rows["TUNIX_MAX_STAGED_BATCHES"].endswith(
      "(env: sized each step from 2; TUNIX_MAX_STAGED_BATCHES=2 fixes it)")
  assert rows["TUNIX_STAGE_MAX_HOST_BATCHES"].endswith(
      "auto     (default: sized each step from 1; TUNIX_STAGE_MAX_HOST_BATCHES=1 fixes it)")
  out = _cli("config", env={"TUNIX_MAX_STAGED_BATCHES": "2"})
  assert "TUNIX_MAX_STAGED_BATCHES         2        (env)" in out.stdout.splitlines()
  assert ("(default: a quarter of this machine's physical memory)"
          in rows["TUNIX_STAGE_MEMORY_BUDGET"])
  # A machine's own default is not passed on to another machine's process; a set one is.
  out = _cli("config", "--env_for", "trainer", env={})
  assert "TUNIX_STAGE_MEMORY_BUDGET" not in out.stdout
  out = _cli("config", "--env_for", "trainer", env={"TUNIX_STAGE_MEMORY_BUDGET": "512MiB"})
  assert "TUNIX_STAGE_MEMORY_BUDGET=512MiB" in out.stdout.splitlines()
