"""`tunix-stage config --driver MAIN` and the doctor's drivers: which drivers take the staging
flags (the launch recipes pass them to no other)."""

from __future__ import annotations

import json

import pytest

from tunix_stage_plugin.cli import main as cli_main

DEEPSWE = "tunix.experimental.examples.deepswe_dist.run_deepswe_dist"
GSM8K = "tunix.experimental.examples.math_gsm8k_dist.run_gsm8k_dist_grpo"
EMBEDDED = "tunix_stage_plugin.lab.embedded.orchestrator_main"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
  for name in ("TUNIX_STAGE_BATCH", "TUNIX_MAX_STAGED_BATCHES", "TUNIX_STAGE_CODEC"):
    monkeypatch.delenv(name, raising=False)


def config(capsys, *args):
  code = cli_main.main(["config", *args])
  out = capsys.readouterr()
  return code, out.out, out.err


@pytest.mark.parametrize("main", [f"{DEEPSWE}.main", DEEPSWE, f"{GSM8K}.main", EMBEDDED,
                                  f"{EMBEDDED}:main"])
def test_a_known_driver_gets_the_orchestrators_flags(capsys, monkeypatch, main):
  monkeypatch.setenv("TUNIX_STAGE_BATCH", "stage")
  monkeypatch.setenv("TUNIX_MAX_STAGED_BATCHES", "3")
  assert config(capsys, "--flags_for", "orchestrator", "--driver", main) == (
      0, "--stage_train_batches=stage\n--max_staged_batches=3\n", "")


@pytest.mark.parametrize("main", ["my_pkg.my_driver.main", f"{DEEPSWE}x.main",
                                  "tunix.experimental.examples.deepswe_dist.main"])
def test_any_other_driver_gets_no_flag(capsys, monkeypatch, main):
  monkeypatch.setenv("TUNIX_STAGE_BATCH", "stage")
  assert config(capsys, "--flags_for", "orchestrator", "--driver", main) == (0, "", "")
  assert config(capsys, "--flags_for", "orchestrator")[1] != ""  # without --driver: as before


def test_staging_off_gives_no_flag_to_any_driver(capsys):
  assert config(capsys, "--flags_for", "orchestrator", "--driver", f"{DEEPSWE}.main") == (
      0, "", "")


def test_config_says_whether_a_driver_takes_the_flags(capsys):
  code, out, _ = config(capsys, "--driver", f"{DEEPSWE}.main")
  assert code == 0 and out == (
      f"{DEEPSWE}.main: takes the staging flags: tunix's DeepSWE GRPO driver (newer tunix "
      "main), the plugin adds them to its _parse_args when staging is on\n")
  code, out, _ = config(capsys, "--driver", "my_pkg.main")
  assert code == 0 and out.startswith(
      "my_pkg.main: not a driver known to take the staging flags; it reads the staging settings "
      f"from the environment only (known: {DEEPSWE}, {GSM8K}, {EMBEDDED})")


def test_doctor_lists_the_drivers_that_take_the_flags(capsys):
  assert cli_main.main(["doctor"]) in (0, 1)
  out = capsys.readouterr().out
  lines = out.splitlines()
  head = lines.index("drivers that take the staging flags (the launch recipes pass them to no "
                     "other; any other driver reads the staging settings from the environment "
                     "only):")
  assert lines[head + 1].startswith(f"  {DEEPSWE}: tunix's DeepSWE GRPO driver (newer tunix "
                                    "main), the plugin adds them to its _parse_args when "
                                    "staging is on [")
  assert lines[head + 3] == (f"  {EMBEDDED}: the embedded host's orchestrator, its own flags "
                             "[in this environment]")
  assert cli_main.main(["doctor", "--json"]) in (0, 1)
  report = json.loads(capsys.readouterr().out)
  assert [d["module"] for d in report["drivers"]] == [DEEPSWE, GSM8K, EMBEDDED]
  assert report["drivers"][2]["installed"] is True


@pytest.mark.parametrize("args, message", [
    (["--check", "--json"], "--json is invalid: --check is given too, and each prints something "
     "else; accepted: one of --check, --json, --env_for, --flags_for"),
    (["--env_for", "trainer", "--flags_for", "trainer"], "--flags_for is invalid: --env_for is "
     "given too"),
    (["--json", "--driver", DEEPSWE], f"--driver='{DEEPSWE[:32]}'... ({len(DEEPSWE)} characters) "
     "is invalid: --json does not read it; accepted: --driver alone, or with --flags_for"),
    (["--env_for", "rollout"], "--env_for='rollout' is invalid; accepted: orchestrator | trainer"),
])
def test_an_output_flag_that_another_would_silently_override_is_refused(capsys, args, message):
  code, out, err = config(capsys, *args)
  assert (code, out) == (2, "")
  assert err.startswith(f"tunix-stage config: error: {message}") and err.count("\n") == 1, err
