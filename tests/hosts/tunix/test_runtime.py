"""A job launched as tunix launches it: `python -S -m tunix.experimental.distributed.runtime.main
--process_main=...`, on a tunix that carries our upstream patch (patches/
tunix-plugins-entry-point.patch: tunix's runtime loads the `tunix.plugins` entry points).

`-S` means no site module, so no `.pth` file runs: neither the plugin's bootstrap nor the editable
installs' finders. The processes import tunix, the plugin and every library from PYTHONPATH (the
venv's site-packages, the tunix tree, this checkout), and the plugin can only be activated by the
entry point tunix's runtime calls. Two processes each time, as in production: a trainer node
(test_grpc.py's, one TrainerWorker over tunix's GrpcRemoteExecutionServer) and an orchestrator
(test_grpc.py's job: a real StandardRLProgram and DistributedRLEngine), both launched through the
runtime. With TUNIX_STAGE_BATCH=stage and no override (no TUNIX_STAGE_ACCEPT_TRAIN_STAGE), both
install their hooks, the train loop through tunix's seam, and the job stages; without it, nothing
is installed and tunix trains alone. The two give bitwise equal parameters.

Skipped on a tunix without the entry point (c7d8950 as released): its runtime loads no plugin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig

import pytest

pytest.importorskip("tunix.experimental.orchestrator.rl_program",
                    reason="tunix's experimental stack (google/tunix main) is not importable")

import tunix  # pylint: disable=wrong-import-position
import tunix_stage_plugin

from tests.hosts.tunix import test_grpc

RUNTIME = "tunix.experimental.distributed.runtime.main"
JOB = "tests.hosts.tunix.test_grpc"
CHECKOUT = os.path.dirname(os.path.dirname(tunix_stage_plugin.__file__))
TREE = os.path.dirname(os.path.dirname(tunix.__file__))
STEPS_TIMEOUT_S = 300

try:
  from tunix.experimental import plugins  # pylint: disable=unused-import
  LOADS_PLUGINS = True
except ImportError:
  LOADS_PLUGINS = False

# A skip of the selected tests, not of the module: a run that selects none of them (the MaxText
# venv's `-m maxtext`) reports no skip.
pytestmark = [pytest.mark.tunix, pytest.mark.loop_way, pytest.mark.skipif(
    not LOADS_PLUGINS, reason="this tunix's runtime loads no plugin "
    "(patches/tunix-plugins-entry-point.patch is not applied)")]


def _env(staging: bool) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("TUNIX_", "PYTHON")) and k != "VIRTUAL_ENV"}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
             PYTHONWARNINGS="ignore",
             PYTHONPATH=os.pathsep.join([sysconfig.get_paths()["purelib"], TREE, CHECKOUT]))
  if staging:
    env["TUNIX_STAGE_BATCH"] = "stage"
  return env


def _launch(main: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
  return subprocess.Popen(
      [sys.executable, "-S", "-m", RUNTIME, f"--process_main={JOB}.{main}", *args],
      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
      cwd=CHECKOUT)


def _job(staging: bool) -> tuple[dict, dict, str, str]:
  """Trainer node, then the orchestrator's job against it; both launched by tunix's runtime.
  Answers (the orchestrator's result, the trainer's plugin, both stderrs)."""
  env = _env(staging)
  node = _launch("runtime_trainer_main", [], env)
  try:
    ports = node.stdout.readline()
    if not ports:
      node.wait(30)
      pytest.fail(f"the trainer node did not start:\n{node.stderr.read()[-3000:]}")
    job = _launch("runtime_orchestrator_main", ["--port", str(json.loads(ports)["runtime"])],
                  env)
    out, job_err = job.communicate(timeout=STEPS_TIMEOUT_S)
    assert job.returncode == 0, job_err[-3000:]
  finally:
    node.stdin.close()
    node_out = node.stdout.read()
    assert node.wait(60) == 0 and "stopped" in node_out, node.stderr.read()[-3000:]
  node_err = node.stderr.read()
  trainer = json.loads(next(line for line in node_err.splitlines() if line.startswith("{")))
  return json.loads(out.splitlines()[-1]), trainer, job_err, node_err


@pytest.fixture(scope="module")
def plain_job():
  return _job(staging=False)


def test_launched_by_tunix_s_runtime_with_minus_S_the_plugin_stages_through_the_seam(plain_job):
  staged, trainer, job_err, node_err = _job(staging=True)
  for who, plugin, err in (("orchestrator", staged["plugin"], job_err),
                           ("trainer", trainer, node_err)):
    assert plugin["site"] is False, who  # no .pth file ran: only the entry point activated it
    assert plugin["installed"], f"{who}: {err[-2000:]}"
    assert any(h.endswith("StandardRLProgram._train_microbatches") for h in plugin["hooks"])
    line = [ln for ln in err.splitlines() if ln.startswith("tunix-stage: staging on for tunix")]
    assert len(line) == 1 and "staged through its seam" in line[0], (who, err[-2000:])
    assert "does not match" not in err and "fingerprint" not in err, who  # no refusal, no override
  metrics = staged["metrics"]
  assert len(metrics) == test_grpc.STEPS and all(m["stage/fallbacks"] == 0 for m in metrics)
  staged_count = sum(m["stage/staged"] for m in metrics)
  assert staged_count >= test_grpc.STEPS * test_grpc.MICRO // 2, metrics
  # The trainer's own record: the staged micro-batches arrived placed and sharded.
  assert staged["inputs"].count("P('fsdp',)") == staged_count
  assert [m["stage/staged"] + m["stage/inline"] for m in metrics] == [test_grpc.MICRO] * 2

  plain, plain_trainer, plain_err, _ = plain_job
  assert not plain["plugin"]["installed"] and not plain_trainer["installed"]
  assert "tunix-stage:" not in plain_err  # staging off: the plugin says nothing
  assert plain["inputs"] == ["host"] * (test_grpc.STEPS * test_grpc.MICRO)
  assert plain["metrics"] == [None] * test_grpc.STEPS  # tunix's own RLStepResult
  assert staged["params"] == plain["params"]  # bitwise equal parameters


def test_the_bootstrap_and_tunix_s_plugin_loader_in_one_process_say_one_line():
  """Without `-S` both activations run in one process: the `.pth` bootstrap waits for tunix's
  modules, and tunix's runtime calls the `tunix.plugins` entry point, whose install imports those
  modules, so the bootstrap's install runs nested inside it. One installation and one line; no
  refusal of hooks the nested install just applied."""
  env = {k: v for k, v in _env(staging=True).items() if k != "PYTHONPATH"}
  env["PYTHONPATH"] = os.pathsep.join([CHECKOUT, TREE])  # the venv's site: its .pth runs
  code = ("from tunix.experimental import plugins; import tunix_stage_plugin.activation.bootstrap "
          "as b; assert b._started, 'no .pth bootstrap ran'; plugins.load_plugins()")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                        cwd=CHECKOUT, timeout=STEPS_TIMEOUT_S)
  assert proc.returncode == 0, proc.stderr[-3000:]
  said = [line for line in proc.stderr.splitlines() if line.startswith("tunix-stage:")]
  assert len(said) == 1 and said[0].startswith("tunix-stage: staging on for tunix"), said
