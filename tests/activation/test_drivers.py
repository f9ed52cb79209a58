"""A known driver takes the staging flags without being edited; with staging off it is untouched.

The driver is the stand-in of tunix's DeepSWE driver that tests/drivers.py writes (its docstring
says why it is not tunix's file), under the real module name, run in a fresh interpreter with the
installed .pth bootstrap (the patches are process-global). tunix itself is not installed here:
the host's hooks are refused with one line, and the driver still takes the flags, so a launch
with staging on never stops at "unrecognized arguments". Against real tunix:
tests/hosts/tunix/test_drivers.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from tests import drivers
from tunix_stage_plugin.hosts import triggers
from tunix_stage_plugin.activation import manager
from tunix_stage_plugin.core import config
from tunix_stage_plugin.core import patching

# The orchestrator arguments the launch recipes pass (mlperf_base.sh), and a few of its own.
DRIVER_ARGS = ["--model_id=Qwen/Qwen3-1.7B", "--tokenizer_path=Qwen/Qwen3-1.7B", "--batch_size=8",
               "--num_generations=4", "--max_steps=100", "--max_prompt_length=1024",
               "--max_response_length=1024", "--train_micro_batch_size=8",
               "--learning_rate=1.0e-6", "--rollout_replicas=1", "--stop_workers_on_exit",
               "--offpolicy", "1", "--no-use_rollout_logps", "--trajectory_store_root", "/tmp/t"]
STAGING_KEYS = {"stage_train_batches", "max_staged_batches", "stage_codec",
                "stage_accept_train_stage", "stage_metrics", "stage_log_every",
                "stage_memory_budget"}
RUN_DRIVER = f"import sys; from {drivers.PACKAGE} import run_deepswe_dist; " \
             "run_deepswe_dist.main(sys.argv[1:])"
(DEEPSWE,) = [d for d in triggers.KNOWN_DRIVERS if d.module == drivers.MODULE]


@pytest.fixture
def driver_path(tmp_path):
  return drivers.write_plain(tmp_path / "driver")


def run_driver(path, *argv, **env_updates):
  env = {k: v for k, v in os.environ.items() if not k.startswith("TUNIX_")}
  env.update(PYTHONPATH=str(path), **env_updates)
  return subprocess.run([sys.executable, "-c", RUN_DRIVER, *argv], env=env, capture_output=True,
                        text=True, timeout=60, check=False)


def test_with_staging_on_the_driver_takes_the_flags_and_leaves_the_rest_to_it(driver_path):
  plain = drivers.report(run_driver(driver_path, *DRIVER_ARGS).stdout)
  proc = run_driver(driver_path, "--stage_train_batches", *DRIVER_ARGS[:5], "--max_staged_batches",
                    "3", *DRIVER_ARGS[5:], "--stage_codec=off", TUNIX_STAGE_BATCH="stage",
                    TUNIX_MAX_STAGED_BATCHES="5")
  assert proc.returncode == 0, proc.stderr
  staged = drivers.report(proc.stdout)
  assert staged["parse_wrapped"] and not plain["parse_wrapped"]
  # Flags beat the environment; the effective values are on the driver's namespace.
  assert {k: staged["args"][k] for k in STAGING_KEYS} == {
      "stage_train_batches": "stage", "max_staged_batches": 3, "stage_codec": "off",
      "stage_accept_train_stage": "", "stage_metrics": "", "stage_log_every": 1,
      "stage_memory_budget": config.machine_budget()}
  # Every other argument reached the driver's own parser as it was, in order.
  assert {k: v for k, v in staged["args"].items() if k not in STAGING_KEYS} == plain["args"]
  assert plain["args"]["max_staleness"] == 1 and plain["args"]["use_rollout_logps"] is False
  # No tunix here: its hooks are refused in one line; the driver goes on with the flags taken.
  (line,) = proc.stderr.splitlines()
  assert line.startswith("tunix-stage: tunix is not importable"), line


@pytest.mark.parametrize("argv, want", [
    ((), ("stage", 5)),  # no flag: the environment
    (("--stage_train_batches=off",), ("off", 5)),  # the flag beats TUNIX_STAGE_BATCH=stage
    (("--max_staged_batches=2",), ("stage", 2)),
])
def test_the_environment_fills_in_what_no_flag_gives(driver_path, argv, want):
  proc = run_driver(driver_path, *argv, TUNIX_STAGE_BATCH="stage", TUNIX_MAX_STAGED_BATCHES="5")
  assert proc.returncode == 0, proc.stderr
  args = drivers.report(proc.stdout)["args"]
  assert (args["stage_train_batches"], args["max_staged_batches"]) == want


@pytest.mark.parametrize("env", [{}, {"TUNIX_STAGE_BATCH": "off"}])
def test_with_staging_off_the_driver_is_untouched(driver_path, env):
  proc = run_driver(driver_path, *DRIVER_ARGS, **env)
  assert proc.returncode == 0 and proc.stderr == ""
  report = drivers.report(proc.stdout)
  assert not report["parse_wrapped"] and not report["plugin_loaded"]
  assert not STAGING_KEYS & set(report["args"])
  rejected = run_driver(driver_path, *DRIVER_ARGS, "--stage_train_batches", **env)
  assert rejected.returncode == 2
  assert "error: unrecognized arguments: --stage_train_batches" in rejected.stderr


def test_a_bad_staging_flag_stops_the_driver_with_one_line(driver_path):
  proc = run_driver(driver_path, "--max_staged_batches", "0", TUNIX_STAGE_BATCH="stage")
  assert proc.returncode == 2 and proc.stdout == ""
  assert proc.stderr.splitlines() == [
      f"{drivers.MODULE}: error: --max_staged_batches='0' is invalid; accepted: auto, or an "
      "integer >= 1 and <= 1024"]
  # A bad flag of the driver's own is the driver's own error, as without the plugin.
  own = run_driver(driver_path, "--batch_size", "x", TUNIX_STAGE_BATCH="stage")
  assert own.returncode == 2 and "argument --batch_size: invalid int value: 'x'" in own.stderr


def test_help_lists_the_drivers_flags_then_the_staging_flags(driver_path):
  proc = run_driver(driver_path, "--help", TUNIX_STAGE_BATCH="stage")
  assert proc.returncode == 0, proc.stderr
  out = proc.stdout
  assert "--batch_size" in out and "staging (tunix-stage-plugin):" in out
  assert out.index("--batch_size") < out.index("--max_staged_batches")
  assert "--stage_train_batches [off|stage]" in out and "--stage_codec" in out


def test_a_driver_of_another_shape_gets_no_flags_and_one_line(driver_path):
  path = driver_path.joinpath(*drivers.MODULE.split(".")).with_suffix(".py")
  path.write_text(path.read_text().replace("def _parse_args(argv):",
                                           "def _parse_args(argv, defaults=None):"))
  proc = run_driver(driver_path, "--batch_size=2", TUNIX_STAGE_BATCH="stage")
  assert proc.returncode == 0, proc.stderr
  assert not drivers.report(proc.stdout)["parse_wrapped"]
  assert [l for l in proc.stderr.splitlines() if "_parse_args" in l] == [
      f"tunix-stage: {drivers.MODULE}._parse_args(argv, defaults=None) is not _parse_args(argv); "
      "the driver takes no staging flag and reads the staging settings from the environment "
      "only"]


@pytest.fixture
def driver_module(monkeypatch):
  """The stand-in as a module object in sys.modules (in this process: no import, no tunix)."""
  module = types.ModuleType(drivers.MODULE)
  exec(compile(drivers.source(tunix=False), drivers.MODULE, "exec"), vars(module))  # pylint: disable=exec-used
  monkeypatch.setitem(sys.modules, drivers.MODULE, module)
  manager.uninstall("tunix", quiet=True)
  yield module
  manager.uninstall("tunix", quiet=True)


def test_the_parse_function_is_set_only_while_staging_is_requested_and_restored_exactly(
    driver_module, monkeypatch):
  original = vars(driver_module)["_parse_args"]
  monkeypatch.delenv("TUNIX_STAGE_BATCH", raising=False)
  manager.hook_driver(DEEPSWE)  # staging not requested: nothing is touched
  assert vars(driver_module)["_parse_args"] is original and manager.hooked_drivers() == []
  monkeypatch.setenv("TUNIX_STAGE_BATCH", "stage")
  manager.hook_driver(DEEPSWE)
  manager.hook_driver(DEEPSWE)  # once
  assert vars(driver_module)["_parse_args"].__wrapped__ is original
  assert manager.hooked_drivers() == [drivers.MODULE]
  args = driver_module._parse_args(["--batch_size", "3", "--max_staged_batches", "4"])  # pylint: disable=protected-access
  assert (args.batch_size, args.max_staged_batches, args.stage_train_batches) == (3, 4, "stage")
  manager.uninstall("tunix", quiet=True)
  assert vars(driver_module)["_parse_args"] is original
  assert patching.SENTINEL not in vars(driver_module) and manager.hooked_drivers() == []


def test_the_known_drivers_are_the_upstream_ones_and_the_embedded_orchestrator():
  assert [(d.module, d.host, d.parse) for d in triggers.KNOWN_DRIVERS] == [
      (drivers.MODULE, "tunix", "_parse_args"),
      ("tunix.experimental.examples.math_gsm8k_dist.run_gsm8k_dist_grpo", "tunix", "_parse_args"),
      ("tunix_stage_plugin.lab.embedded.orchestrator_main", "embedded", None),
  ]


def test_a_driver_that_defines_the_flags_itself_is_left_alone(driver_path):
  """The upstream change merged: the driver's own --stage_train_batches, no second one."""
  path = driver_path.joinpath(*drivers.MODULE.split(".")).with_suffix(".py")
  path.write_text(path.read_text().replace(
      "  return parser.parse_args(argv)",
      "  parser.add_argument('--stage_train_batches', default='native')\n"
      "  return parser.parse_args(argv)"))
  proc = run_driver(driver_path, "--stage_train_batches=stage", TUNIX_STAGE_BATCH="stage")
  assert proc.returncode == 0, proc.stderr
  report = drivers.report(proc.stdout)
  assert not report["parse_wrapped"] and report["args"]["stage_train_batches"] == "stage"
  assert "max_staged_batches" not in report["args"] and proc.stderr == ""
