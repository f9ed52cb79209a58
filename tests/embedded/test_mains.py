"""The two process entry points a launch recipe calls: trainer_main and orchestrator_main."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from tests.embedded.support import call
from tunix_stage_plugin.embedded import process as process_lib

ORCH = [sys.executable, "-m", "tunix_stage_plugin.embedded.orchestrator_main"]
TRAINER = [sys.executable, "-m", "tunix_stage_plugin.embedded.trainer_main"]
STAGING_ENV = ("TUNIX_STAGE_BATCH", "TUNIX_MAX_STAGED_BATCHES", "TUNIX_STAGE_MAX_DEVICE_BATCHES")


def _env(**values: str) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if k not in STAGING_ENV}
  env.update(values)
  return env


def _orchestrate(address: str, *args: str, **env: str) -> subprocess.CompletedProcess:
  return subprocess.run([*ORCH, "--trainer", address, "--tiny", "--steps", "2",
                         "--microbatches", "3", *args], env=_env(**env), capture_output=True,
                        text=True, timeout=120)


def _digest(stdout: str) -> str:
  return re.search(r"param_digest ([0-9a-f]{16})", stdout).group(1)


def test_staged_and_inline_orchestrators_against_one_trainer_then_sigterm():
  with process_lib.TrainerProcess(extra_args=["--fail_stage_ids", "s1-m1"]) as trainer:
    staged = _orchestrate(trainer.address, TUNIX_STAGE_BATCH="stage")
    inline = _orchestrate(trainer.address, "--stage_train_batches", "off",
                          TUNIX_STAGE_BATCH="stage")  # the flag beats the env
    assert call(trainer.address, "info")["staged_keys"] == []
  assert trainer.proc.returncode == 0
  assert staged.returncode == 0, staged.stderr
  summary = staged.stdout.strip().splitlines()[-1]
  assert summary.startswith("orchestrator_main: OK: 2 steps x 3 micro-batches, staging stage "
                            "depth=2 prestage=on, trainer staging stage")
  assert "stage/fallbacks per step [0, 1]" in summary  # s1-m1 failed in the worker
  assert "trained once in order: yes" in summary
  assert len(staged.stdout.strip().splitlines()) == 3  # a line per step, then the summary
  assert inline.returncode == 0, inline.stderr
  assert "staging off (inline)" in inline.stdout
  assert "stage/fallbacks per step [0, 0]" in inline.stdout
  assert _digest(inline.stdout) == _digest(staged.stdout)


def test_both_off_is_a_plain_inline_trainer():
  with process_lib.TrainerProcess(mode="off") as trainer:
    result = _orchestrate(trainer.address, TUNIX_STAGE_BATCH="off")
    threads = call(trainer.address, "info")["threads"]
  assert result.returncode == 0, result.stderr
  assert "staging off (inline), trainer staging off" in result.stdout
  assert not any("staging" in t for t in threads), threads
  assert trainer.proc.returncode == 0


def test_trainer_main_prints_ready_and_exits_zero_on_sigint():
  proc = subprocess.Popen([*TRAINER, "--port", "0"], stdout=subprocess.PIPE, text=True,
                          env=_env(TUNIX_STAGE_BATCH="stage", TUNIX_STAGE_MAX_DEVICE_BATCHES="3"))
  try:
    line = proc.stdout.readline()
    assert re.fullmatch(r"READY 127\.0\.0\.1:\d+\n", line), line
    info = call(line.split()[1], "info")
    assert info["mode"] == "stage" and info["max_device_batches"] == 3
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
    proc.stdout.close()


def test_a_trainer_that_exits_before_ready_is_reported_with_its_exit_code():
  with pytest.raises(process_lib.TrainerProcessError, match="exited with code 2 before READY"):
    process_lib.TrainerProcess(extra_args=["--max_device_batches", "0"])


@pytest.mark.parametrize("cmd, env, code, message", [
    (TRAINER + ["--port", "0"], {"TUNIX_STAGE_MAX_DEVICE_BATCHES": "0"}, 2,
     "TUNIX_STAGE_MAX_DEVICE_BATCHES='0' is invalid; accepted: an integer >= 1"),
    (TRAINER + ["--port", "0", "--max_device_batches", "x"], {}, 2,
     "--stage_max_device_batches='x' is invalid"),
    (ORCH + ["--trainer", "127.0.0.1"], {}, 2, "trainer address must be HOST:PORT"),
    (ORCH + ["--trainer", "127.0.0.1:1", "--connect_timeout_s", "1"], {}, 1,
     "trainer at 127.0.0.1:1 did not answer"),
    (ORCH + ["--trainer", "127.0.0.1:1"], {"TUNIX_MAX_STAGED_BATCHES": "two"}, 2,
     "TUNIX_MAX_STAGED_BATCHES='two' is invalid"),
    (ORCH + ["--trainer", "127.0.0.1:1", "--liveness_s", "0.5"], {}, 2,
     "liveness bound (--liveness_s): accepted a number of seconds >= 1; got 0.5"),
    (TRAINER + ["--port", "0", "--shutdown_grace_s", "-1"], {}, 2,
     "'-1': accepted a number of seconds >= 0"),
    (TRAINER + ["--port", "0", "--max_call_mib", "0"], {}, 2,
     "'0': accepted an integer number of MiB >= 1"),
    # stdin is /dev/null here: nothing to watch for the parent's death.
    (TRAINER + ["--port", "0", "--exit_with_parent", "pipe"], {}, 2,
     "--exit_with_parent pipe/both: stdin must be a pipe from the parent process"),
])
def test_bad_settings_and_an_absent_trainer_fail_with_a_clear_message(cmd, env, code, message):
  result = subprocess.run(cmd, env=_env(**env), stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == code, result.stderr
  assert message in result.stderr
