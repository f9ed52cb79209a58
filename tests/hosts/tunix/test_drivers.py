"""tunix's drivers take the staging flags with staging on, and are untouched with it off.

Against real tunix (main c7d8950): its GSM8K driver (tunix/experimental/examples/math_gsm8k_dist/
run_gsm8k_dist_grpo.py, a plain argparse `_parse_args(argv)`), and the stand-in of its DeepSWE
driver that tests/drivers.py writes (the DeepSWE file is not in c7d8950; tests/drivers.py says
why it is not copied), importing tunix's experimental modules at its top as the real one does.
Each run is a fresh interpreter with the installed .pth bootstrap. The launch recipes end to end
with tunix's runtime: tests/recipes/test_local.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("tunix.experimental.orchestrator.rl_program",
                    reason="tunix's experimental stack (google/tunix main) is not importable")

from tests import drivers  # pylint: disable=wrong-import-position

pytestmark = pytest.mark.tunix
GSM8K = "tunix.experimental.examples.math_gsm8k_dist.run_gsm8k_dist_grpo"
PARSE_GSM8K = (
    "import json, sys\n"
    f"from {GSM8K.rsplit('.', 1)[0]} import run_gsm8k_dist_grpo as driver\n"
    "from tunix.experimental.orchestrator import rl_program\n"
    "args = driver._parse_args(sys.argv[1:])\n"
    "print('ARGS ' + json.dumps({'args': vars(args), 'seams': hasattr(\n"
    "    rl_program.StandardRLProgram, '_prestage_across_boundary')}, default=str))\n")
RUN_STAND_IN = f"import sys; from {drivers.PACKAGE} import run_deepswe_dist; " \
               "run_deepswe_dist.main(sys.argv[1:])"


def run_fresh(code, *argv, pythonpath=(), **env_updates):
  env = {k: v for k, v in os.environ.items() if not k.startswith("TUNIX_")}
  env.update(JAX_PLATFORMS="cpu", **env_updates)
  env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), env.get("PYTHONPATH", "")])
  return subprocess.run([sys.executable, "-W", "ignore", "-c", code, *argv], env=env,
                        capture_output=True, text=True, timeout=180, check=False)


def parsed(proc):
  assert proc.returncode == 0, proc.stderr[-3000:]
  (line,) = [l for l in proc.stdout.splitlines() if l.startswith("ARGS ")]
  return json.loads(line.removeprefix("ARGS "))


def plugin_lines(proc):
  return [l for l in proc.stderr.splitlines() if l.startswith("tunix-stage")]


@pytest.fixture(scope="module")
def gsm8k():
  pytest.importorskip(GSM8K, reason="the GSM8K driver's dependencies (transformers) are not "
                      "importable")


def test_tunixs_gsm8k_driver_takes_the_staging_flags_with_staging_on(gsm8k):
  proc = run_fresh(PARSE_GSM8K, "--max_steps", "3", "--stage_train_batches",
                   "--max_staged_batches", "2", TUNIX_STAGE_BATCH="stage",
                   TUNIX_MAX_STAGED_BATCHES="5")
  report = parsed(proc)
  args = report["args"]
  assert args["max_steps"] == 3 and args["rpc_timeout_s"] == 1800.0  # the driver's own, intact
  assert (args["stage_train_batches"], args["max_staged_batches"]) == ("stage", 2)  # flags win
  assert report["seams"] is True
  # The hooks installed at tunix's import with the environment's 5; the flags then set 2: the
  # second line says what is in force and where each value came from.
  installed, now = plugin_lines(proc)
  assert "staging on for tunix" in installed and " hooks (server: " in installed
  assert "max_staged_batches=5 (TUNIX_MAX_STAGED_BATCHES)" in installed
  assert now == ("tunix-stage: staging settings now in force for tunix: max_staged_batches=2 "
                 "(--max_staged_batches), max_device_batches=1, max_host_batches=auto, codec=off "
                 "[--stage_train_batches=stage]")


def test_tunixs_gsm8k_driver_flag_off_removes_the_hooks(gsm8k):
  proc = run_fresh(PARSE_GSM8K, "--stage_train_batches=off", TUNIX_STAGE_BATCH="stage")
  report = parsed(proc)
  assert report["args"]["stage_train_batches"] == "off" and report["seams"] is False
  assert plugin_lines(proc)[-1] == ("tunix-stage: staging is off (--stage_train_batches=off); "
                                    "hooks removed")


@pytest.mark.parametrize("env", [{}, {"TUNIX_STAGE_BATCH": "off"}])
def test_with_staging_off_tunixs_gsm8k_driver_is_untouched(gsm8k, env):
  report = parsed(run_fresh(PARSE_GSM8K, "--max_steps", "3", **env))
  assert "stage_train_batches" not in report["args"] and report["seams"] is False
  proc = run_fresh(PARSE_GSM8K, "--max_steps", "3", "--stage_train_batches", **env)
  assert proc.returncode == 2
  assert "error: unrecognized arguments: --stage_train_batches" in proc.stderr


def test_the_deepswe_shaped_driver_takes_the_flags_next_to_real_tunix(tmp_path):
  shim = drivers.write_for_tunix(tmp_path / "driver")
  proc = run_fresh(RUN_STAND_IN, "--batch_size=8", "--stage_train_batches=stage",
                   "--max_staged_batches=3", "--offpolicy", "1", pythonpath=[shim],
                   TUNIX_STAGE_BATCH="stage")
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = drivers.report(proc.stdout)
  assert report["parse_wrapped"] and report["seams"] == [True, True]
  args = report["args"]
  assert (args["batch_size"], args["max_staleness"]) == (8, 1)
  assert (args["stage_train_batches"], args["max_staged_batches"]) == ("stage", 3)
  # The hooks installed when the driver imported tunix (the default depth, auto); its flags then
  # set 3, and one line says what is in force and where each value came from.
  installed, now = plugin_lines(proc)
  assert "staging on for tunix" in installed and "max_staged_batches=auto," in installed
  assert now == ("tunix-stage: staging settings now in force for tunix: max_staged_batches=3 "
                 "(--max_staged_batches), max_device_batches=1, max_host_batches=auto, codec=off "
                 "[--stage_train_batches=stage]")
  off = run_fresh(RUN_STAND_IN, "--batch_size=8", pythonpath=[shim])
  report = drivers.report(off.stdout)
  assert not report["parse_wrapped"] and report["seams"] == [False, False]
  assert plugin_lines(off) == []


def test_a_deepswe_shaped_driver_of_another_shape_is_said_once_next_to_real_tunix(tmp_path):
  """Both watches fire on its import (the hooks' install, then the driver's): one line."""
  shim = drivers.write_for_tunix(tmp_path / "driver")
  path = tmp_path / "driver" / "deepswe_dist" / "run_deepswe_dist.py"
  path.write_text(path.read_text().replace("def _parse_args(argv):",
                                           "def _parse_args(argv, defaults=None):"))
  proc = run_fresh(RUN_STAND_IN, "--batch_size=8", pythonpath=[shim], TUNIX_STAGE_BATCH="stage")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert not drivers.report(proc.stdout)["parse_wrapped"]
  lines = plugin_lines(proc)
  assert len(lines) == 2 and "staging on for tunix" in lines[0], lines
  assert lines[1].endswith("is not _parse_args(argv); the driver takes no staging flag and reads "
                           "the staging settings from the environment only")


def test_the_deepswe_driver_run_as_a_script_says_how_to_give_it_flags(tmp_path):
  """`python -m DRIVER`: the driver is __main__, its parse function defined after the imports
  that install staging, so it cannot take the flags: one line says so and what to do."""
  shim = drivers.write_for_tunix(tmp_path / "driver")
  env = {k: v for k, v in os.environ.items() if not k.startswith("TUNIX_")}
  env.update(JAX_PLATFORMS="cpu", TUNIX_STAGE_BATCH="stage",
             PYTHONPATH=os.pathsep.join([str(shim), env.get("PYTHONPATH", "")]))
  proc = subprocess.run([sys.executable, "-W", "ignore", "-m", drivers.MODULE, "--batch_size=8"],
                        env=env, capture_output=True, text=True, timeout=180, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = plugin_lines(proc)
  assert len(lines) == 2 and "staging on for tunix" in lines[1], lines
  assert lines[0] == (
      f"tunix-stage: {drivers.MODULE} runs as a script (python -m), so its command line takes "
      "no staging flag (--stage_train_batches, --max_staged_batches, ...); set the staging "
      "variables (TUNIX_STAGE_BATCH, TUNIX_MAX_STAGED_BATCHES) instead, or launch it by name as "
      f"tunix's runtime does (--process_main={drivers.MODULE}.main)")
  assert drivers.report(proc.stdout)["args"]["batch_size"] == 8
