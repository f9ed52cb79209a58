"""`tunix-stage bench` and the staging variables: TUNIX_STAGE_LOG_EVERY and the bounds and codec
honoured as everywhere (a bad value refused in one line, every one at once), TUNIX_STAGE_METRICS
refused in one line, those each mode sets named when set, and `--quiet` quiet: nothing on stderr,
the trainer's per-step lines included."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tunix_stage_plugin.cli import main as cli_main
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.lab.bench import command as bench_cmd

TINY = ["bench", "--tiny", "--quick", "--steps", "1", "--microbatches", "2", "--payload_mib",
        "0.05", "--modes", "depth2"]


def check(argv, monkeypatch, **env):
  for setting in config_lib.SETTINGS:
    monkeypatch.delenv(setting.env, raising=False)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  args = cli_main.build_parser().parse_args(["bench", *argv])
  return bench_cmd._check(args)  # pylint: disable=protected-access


@pytest.mark.parametrize("value", ["abc", "-1", "1e3", "1000001"])
def test_a_bad_log_every_is_refused_in_one_line(value, monkeypatch, tmp_path):
  options, _, problems = check(["--out", str(tmp_path)], monkeypatch,
                               TUNIX_STAGE_LOG_EVERY=value)
  assert options is None
  assert problems == [f"TUNIX_STAGE_LOG_EVERY='{value}' is invalid; accepted: an integer >= 0 "
                      "and <= 1000000"]


def test_log_every_is_honoured_and_quiet_silences_it(monkeypatch, tmp_path):
  out = ["--out", str(tmp_path)]
  assert check(out, monkeypatch)[0].log_every == 1  # the plugin's default
  assert check(out, monkeypatch, TUNIX_STAGE_LOG_EVERY="5")[0].log_every == 5
  assert check([*out, "--quiet"], monkeypatch, TUNIX_STAGE_LOG_EVERY="5")[0].log_every == 0


def test_a_metrics_folder_is_refused_in_one_line_and_off_is_accepted(monkeypatch, tmp_path):
  options, _, problems = check(["--out", str(tmp_path)], monkeypatch,
                               TUNIX_STAGE_METRICS="metrics")
  assert options is None and len(problems) == 1
  assert problems[0].startswith("TUNIX_STAGE_METRICS='metrics' is invalid: the bench writes no "
                                "metrics record")
  assert problems[0].endswith("; accepted: unset, or off")
  assert check(["--out", str(tmp_path)], monkeypatch, TUNIX_STAGE_METRICS="off")[0] is not None


def test_every_bad_variable_is_refused_at_once(monkeypatch, tmp_path):
  options, _, problems = check(["--out", str(tmp_path)], monkeypatch, TUNIX_STAGE_METRICS="m",
                               TUNIX_STAGE_LOG_EVERY="abc", TUNIX_STAGE_MAX_HOST_BATCHES="0")
  assert options is None
  assert [line.split("=")[0] for line in problems] == [
      "TUNIX_STAGE_METRICS", "TUNIX_STAGE_MAX_HOST_BATCHES", "TUNIX_STAGE_LOG_EVERY"]


def test_the_bounds_and_the_codec_read_their_variables_and_a_flag_beats_them(monkeypatch,
                                                                            tmp_path):
  out = ["--out", str(tmp_path)]
  options = check(out, monkeypatch, TUNIX_STAGE_MAX_DEVICE_BATCHES="3",
                  TUNIX_STAGE_MAX_HOST_BATCHES="2")[0]
  assert (options.max_device_batches, options.max_host_batches, options.codec) == (3, 2, "off")
  options = check([*out, "--stage_max_device_batches", "4"], monkeypatch,
                  TUNIX_STAGE_MAX_DEVICE_BATCHES="3")[0]
  assert options.max_device_batches == 4
  assert check(out, monkeypatch)[0].max_device_batches == 1  # the default
  _, _, problems = check(out, monkeypatch, TUNIX_STAGE_MAX_DEVICE_BATCHES="0")
  assert problems == ["TUNIX_STAGE_MAX_DEVICE_BATCHES='0' is invalid; accepted: an integer >= 1 "
                      "and <= 1024"]


def test_the_variables_each_mode_sets_are_named_when_set(monkeypatch):
  for setting in config_lib.SETTINGS:
    monkeypatch.delenv(setting.env, raising=False)
  assert bench_cmd.unread_note() is None
  monkeypatch.setenv("TUNIX_STAGE_BATCH", "stage")
  monkeypatch.setenv("TUNIX_MAX_STAGED_BATCHES", "3")
  assert bench_cmd.unread_note() == (
      "tunix-stage bench: note: TUNIX_STAGE_BATCH=stage, TUNIX_MAX_STAGED_BATCHES=3 not read: "
      "each mode sets staging and its depth (--modes)")


def test_quiet_prints_nothing_on_stderr_and_log_every_reaches_the_trainer(tmp_path):
  """Real tiny runs: --quiet leaves stderr empty (the trainer process's per-step lines too);
  without it, TUNIX_STAGE_LOG_EVERY=0 leaves the progress lines and no per-step line."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("TUNIX_STAGE_")}
  quiet = subprocess.run([sys.executable, "-m", "tunix_stage_plugin", *TINY, "--out",
                          str(tmp_path / "a"), "--quiet"], capture_output=True, text=True,
                         timeout=240, env=env, check=False)
  assert quiet.returncode == 0, quiet.stderr
  assert quiet.stderr == ""
  assert "depth2" in quiet.stdout  # the table
  none = subprocess.run([sys.executable, "-m", "tunix_stage_plugin", *TINY, "--out",
                         str(tmp_path / "b")], capture_output=True, text=True, timeout=240,
                        env={**env, "TUNIX_STAGE_LOG_EVERY": "0"}, check=False)
  assert none.returncode == 0, none.stderr
  assert "round 1/1 depth2" in none.stderr and "tunix-stage: trainer step" not in none.stderr
