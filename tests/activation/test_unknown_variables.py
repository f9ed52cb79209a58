"""A misspelled staging variable gets one warning where staging activates, and nowhere else.

`TUNIX_STAGE_MAX_STAGED_BATCHES` (the real `TUNIX_MAX_STAGED_BATCHES` breaks its siblings'
TUNIX_STAGE_* pattern) used to change nothing and say nothing. Real interpreters here: the .pth
bootstrap runs at their start, so "off means off" is checked where it matters.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from tunix_stage_plugin.core import config as config_lib

TYPO = "TUNIX_STAGE_MAX_STAGED_BATCHES"
WARNING = (f"tunix-stage: warning: {TYPO} is not a staging variable, so nothing reads it; did you "
           "mean TUNIX_MAX_STAGED_BATCHES? (the settings: docs/configuration.md)")


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
  base = {k: v for k, v in os.environ.items() if not k.startswith("TUNIX_")}
  return subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True,
                        text=True, timeout=60, check=False)


@pytest.mark.parametrize("mode", [None, "off", ""])
def test_with_staging_off_an_interpreter_says_nothing(mode):
  env = {TYPO: "3"} if mode is None else {TYPO: "3", "TUNIX_STAGE_BATCH": mode}
  proc = _python("import sys; print('tunix_stage_plugin.activation.bootstrap' in sys.modules)",
                 **env)
  assert (proc.stdout, proc.stderr) == ("False\n", "")  # the .pth line stayed a dict lookup


def test_a_process_that_activates_staging_warns_once_per_variable():
  proc = _python("import tunix_stage_plugin as t; t.install(); t.install()",
                 TUNIX_STAGE_BATCH="stage", **{TYPO: "3", "TUNIX_STAGE_BATCHES": "stage"})
  assert proc.returncode == 0, proc.stderr
  lines = proc.stderr.splitlines()
  assert lines[:2] == [  # in name order
      "tunix-stage: warning: TUNIX_STAGE_BATCHES is not a staging variable, so nothing reads it; "
      "did you mean TUNIX_STAGE_BATCH? (the settings: docs/configuration.md)",
      WARNING]
  assert sum("warning" in line for line in lines) == 2  # the second install() said none again
  assert all(line.startswith("tunix-stage: tunix is not importable") for line in lines[2:])


def test_a_staging_variable_is_never_warned_about_and_a_new_setting_needs_no_edit(monkeypatch):
  env = {s.env: "x" for s in config_lib.SETTINGS}
  assert config_lib.unknown_variables(env) == []
  assert config_lib.unknown_variables({"TUNIX_STAGE_SPANS": "/tmp/s"}) != []
  new = dataclasses.replace(config_lib.SETTINGS[0], field="spans", env="TUNIX_STAGE_SPANS",
                            flag="stage_spans")
  monkeypatch.setattr(config_lib, "SETTINGS", (*config_lib.SETTINGS, new))
  assert config_lib.unknown_variables({"TUNIX_STAGE_SPANS": "/tmp/s"}) == []
  assert config_lib.unknown_variables({"TUNIX_STAGE_SPAN": "/tmp/s"}) == [
      ("TUNIX_STAGE_SPAN", "TUNIX_STAGE_SPANS")]


def test_another_tool_s_variable_is_left_alone_once_listed(monkeypatch):
  env = {"TUNIX_STAGE_OTHER_TOOL": "1", "TUNIX_OTHER": "1", "PATH": "/bin"}
  assert [name for name, _ in config_lib.unknown_variables(env)] == ["TUNIX_STAGE_OTHER_TOOL"]
  monkeypatch.setattr(config_lib, "OTHER_VARIABLES", ("TUNIX_STAGE_OTHER_TOOL",))
  assert config_lib.unknown_variables(env) == []  # and names outside the prefixes never count


@pytest.mark.parametrize("typo, meant", [
    ("TUNIX_STAGE_MAX_STAGED_BATCHES", "TUNIX_MAX_STAGED_BATCHES"),
    ("TUNIX_STAGE_BATCHES", "TUNIX_STAGE_BATCH"),
    ("TUNIX_MAX_DEVICE_BATCHES", "TUNIX_STAGE_MAX_DEVICE_BATCHES"),
    ("TUNIX_MAX_HOST_BATCHES", "TUNIX_STAGE_MAX_HOST_BATCHES"),
    ("TUNIX_STAGE_CODE", "TUNIX_STAGE_CODEC"),
    ("TUNIX_STAGE_ACCEPT", "TUNIX_STAGE_ACCEPT_TRAIN_STAGE"),
])
def test_the_closest_setting_is_the_one_meant(typo, meant):
  assert config_lib.unknown_variables({typo: "1"}) == [(typo, meant)]
