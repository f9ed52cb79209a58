"""Activation against the real tunix classes: exact reversal, probes, the bootstrap, routing.

(tunix's drivers taking the staging flags: test_drivers.py.)

Subprocess tests run a fresh interpreter (the patches are process-global) with the installed
.pth bootstrap.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import logging
import os
import subprocess
import sys
import textwrap
import threading

import pytest

pytest.importorskip("tunix.experimental.orchestrator.rl_program",
                    reason="tunix's experimental stack (google/tunix main) is not importable")

from tunix.experimental.common import datatypes  # pylint: disable=wrong-import-position
from tunix.experimental.orchestrator import distributed_rl_engine
from tunix.experimental.orchestrator import rl_program
from tunix.experimental.train import peft_trainer_v2
from tunix.experimental.worker import remote_execution
from tunix.experimental.worker import trainer_worker

from tunix_stage_plugin.activation import manager
from tunix_stage_plugin.core import patching
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.hosts import probing
from tunix_stage_plugin.hosts.tunix import probes
from tunix_stage_plugin.hosts.tunix.adapter import ADAPTER

pytestmark = pytest.mark.tunix
HOST_CLASSES = (remote_execution.RemoteExecutionServer, remote_execution.GrpcRemoteExecutionServer,
                remote_execution.InProcessRemoteExecutionServer, trainer_worker.TrainerWorker,
                distributed_rl_engine.DistributedRLEngine, rl_program.StandardRLProgram,
                rl_program.RLStepResult, peft_trainer_v2.PeftTrainer)
STAGE = config_lib.resolve({"mode": "stage"}, env={})
# How this tunix's train loop is staged: the plugin's copy (c7d8950) or tunix's seam (c7d8950 with
# patches/tunix-plugins-entry-point.patch), and the hooks each way installs: server 4, worker 3,
# engine 3, program 3 (train_stage and the upstream change's two methods) and, through the seam,
# 3 more (the seam's two methods and last_step_result). PeftTrainer's seam is one more, set where
# a process first serves a worker (its trainer side), so an orchestrator's PeftTrainer is tunix's.
WAY = probes.loop_way(rl_program.StandardRLProgram)
HOOKS = {probes.COPY: 14, probes.SEAM: 17}[WAY]
copy_only = pytest.mark.skipif(WAY != probes.COPY,
                               reason="the plugin's copy of train_stage only (c7d8950)")
seam_only = pytest.mark.skipif(WAY != probes.SEAM,
                               reason="tunix with the train loop's seam only")


def snapshot():
  return {cls: dict(cls.__dict__) for cls in HOST_CLASSES}


@pytest.fixture
def clean():
  manager.uninstall("tunix", quiet=True)  # e.g. the bootstrap installed at import
  yield
  manager.uninstall("tunix", quiet=True)


@pytest.mark.loop_way
def test_install_uninstall_reinstall_leaves_classes_exactly_as_they_were(clean):
  before = snapshot()
  seams = ("_stage_ahead_while_pending", "_prestage_across_boundary")
  assert not any(hasattr(rl_program.StandardRLProgram, name) for name in seams)
  for _ in range(2):
    activation = manager.install(STAGE, quiet=True)
    assert activation.installed and len(activation.hooks) == HOOKS
    assert trainer_worker.TrainerWorker.__dict__[patching.SENTINEL] is True
    for name in seams:  # the upstream change's seams: real methods, there while installed
      assert callable(vars(rl_program.StandardRLProgram)[name])
      assert f"tunix.experimental.orchestrator.rl_program.StandardRLProgram.{name}" in \
          activation.hooks
    assert manager.install(STAGE, quiet=True).installed  # idempotent
    assert snapshot() != before
    prepare = vars(peft_trainer_v2.PeftTrainer)["_prepare_payload"]
    assert not hasattr(prepare, "__wrapped__")  # no worker served yet: tunix's own
    ADAPTER.installation.trainer_side()  # as the first call a server of this process serves
    assert vars(peft_trainer_v2.PeftTrainer)["_prepare_payload"].__wrapped__ is prepare
    manager.uninstall("tunix", quiet=True)
    assert snapshot() == before
  assert not hasattr(trainer_worker.TrainerWorker, "stage_batch")
  assert not any(hasattr(rl_program.StandardRLProgram, name) for name in seams)


def test_host_that_has_its_own_stage_batch_gets_nothing(clean, monkeypatch, capsys):
  monkeypatch.setattr(trainer_worker.TrainerWorker, "stage_batch", lambda self: None,
                      raising=False)
  before = snapshot()
  assert not manager.install(STAGE).installed
  assert snapshot() == before
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("tunix-stage: tunix 0.1.8")
  assert "does not match (worker: TrainerWorker.fwd_bwd(payload, **kwargs): TrainerWorker " \
         "already has ['stage_batch']" in err[0]


@pytest.mark.loop_way
@copy_only
def test_tunix_c7d8950_s_train_stage_is_the_body_the_staged_loop_reproduces():
  train_stage = rl_program.StandardRLProgram.train_stage
  assert probing.fingerprint(train_stage) == probes.TRAIN_STAGE_FINGERPRINT
  # Reformatted throughout (ast.unparse drops the comments and rewraps every line): the same.
  source = ast.unparse(ast.parse(textwrap.dedent(inspect.getsource(train_stage))))
  assert probing.source_fingerprint(source) == probes.TRAIN_STAGE_FINGERPRINT


def compiled_from_a_file(tree, path):
  """The function `tree` defines, compiled from a file in rl_program's namespace (so its source
  can be read, as a tunix checkout's)."""
  path.write_text(ast.unparse(ast.fix_missing_locations(tree)) + "\n")
  namespace = dict(vars(rl_program))
  exec(compile(path.read_text(), str(path), "exec"), namespace)  # pylint: disable=exec-used
  return namespace["train_stage"]


@pytest.fixture
def newer_train_stage(monkeypatch, tmp_path):
  """A tunix whose train_stage keeps its signature and does one thing more at the end of its body
  (as a newer tunix's per-step checkpoints would): tunix's own source plus one statement, set on
  the class tunix ships for one test (the probe reads that class, not a subclass)."""
  tree = ast.parse(textwrap.dedent(inspect.getsource(rl_program.StandardRLProgram.train_stage)))
  tree.body[0].body.append(ast.parse("self.checkpointed_steps = step").body[0])
  train_stage = compiled_from_a_file(tree, tmp_path / "newer_rl_program.py")
  monkeypatch.setattr(rl_program.StandardRLProgram, "train_stage", train_stage)
  return train_stage


@pytest.mark.loop_way
@copy_only
def test_a_tunix_whose_train_stage_body_changed_gets_nothing(clean, newer_train_stage, capsys):
  found = probing.fingerprint(newer_train_stage)
  assert found != probes.TRAIN_STAGE_FINGERPRINT
  before = snapshot()
  assert not manager.install(STAGE).installed
  assert snapshot() == before
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("tunix-stage: tunix 0.1.8")
  assert err[0].endswith(
      f"does not match (program: StandardRLProgram.train_stage's body: fingerprint {found} "
      f"differs from tunix c7d8950's {probes.TRAIN_STAGE_FINGERPRINT}, the body the plugin's "
      "staged loop reproduces and would replace; upgrade tunix-stage-plugin, or check that the "
      "staged loop still does what this body does (docs/tunix.md) and set "
      f"TUNIX_STAGE_ACCEPT_TRAIN_STAGE={found})")


@pytest.mark.loop_way
@copy_only
def test_the_setting_stages_the_one_body_it_names(clean, newer_train_stage, capsys, caplog):
  found = probing.fingerprint(newer_train_stage)
  accepting = config_lib.resolve({"mode": "stage"},
                                 env={"TUNIX_STAGE_ACCEPT_TRAIN_STAGE": found})
  before = snapshot()
  with caplog.at_level(logging.WARNING, logger="tunix_stage_plugin"):
    activation = manager.install(accepting, quiet=True)
  assert activation.installed and len(activation.hooks) == HOOKS
  assert vars(rl_program.StandardRLProgram)["train_stage"] is not newer_train_stage
  warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING]
  assert warnings == [
      "tunix-stage: the staged loop replaces a StandardRLProgram.train_stage whose body "
      f"(fingerprint {found}) is not tunix c7d8950's ({probes.TRAIN_STAGE_FINGERPRINT}): "
      "accepted by TUNIX_STAGE_ACCEPT_TRAIN_STAGE"]
  manager.uninstall("tunix", quiet=True)
  assert snapshot() == before  # the newer body back, exactly
  # Another fingerprint accepts another body, not this one.
  other = config_lib.resolve({"mode": "stage", "accept_train_stage": "0123456789abcdef"}, env={})
  assert not manager.install(other).installed
  (line,) = capsys.readouterr().err.strip().splitlines()
  assert (f"fingerprint {found} differs" in line and
          "(TUNIX_STAGE_ACCEPT_TRAIN_STAGE=0123456789abcdef accepts another body)" in line)
  assert snapshot() == before


@pytest.mark.loop_way
def test_tunix_s_own_body_stages_whatever_the_setting_names(clean):
  other = config_lib.resolve({"mode": "stage", "accept_train_stage": "0123456789abcdef"}, env={})
  assert manager.install(other, quiet=True).installed


@pytest.mark.loop_way
@copy_only
def test_a_train_stage_without_source_gets_nothing(clean, monkeypatch, capsys):
  namespace = dict(vars(rl_program))
  exec(compile(textwrap.dedent(inspect.getsource(rl_program.StandardRLProgram.train_stage)),  # pylint: disable=exec-used
               "<no file>", "exec"), namespace)
  monkeypatch.setattr(rl_program.StandardRLProgram, "train_stage", namespace["train_stage"])
  before = snapshot()
  assert not manager.install(STAGE).installed
  assert snapshot() == before
  (line,) = capsys.readouterr().err.strip().splitlines()
  assert "StandardRLProgram.train_stage's body: its source is not available" in line


@pytest.mark.loop_way
@pytest.mark.skipif("TUNIX_STAGE_TEST_TREE" not in os.environ,
                    reason="CI names the tree it runs on (.ci/run); a checkout of yours may be "
                    "either")
def test_the_train_loop_is_staged_the_way_this_tree_needs(clean):
  tree = os.environ["TUNIX_STAGE_TEST_TREE"]
  assert WAY == {"plain": probes.COPY, "patched": probes.SEAM}[tree]
  activation = manager.install(STAGE, quiet=True)
  assert activation.installed and probes.describe_loop(WAY) in activation.line
  assert ("fingerprint" in activation.line) == (WAY == probes.COPY)


@pytest.mark.loop_way
@seam_only
def test_through_the_seam_train_stage_is_tunix_s_whatever_its_fingerprint(
    clean, newer_train_stage):
  """The fingerprint pins only the body the copy replaces: through the seam, tunix's train_stage
  (here one statement longer) runs as it is, wrapped, and no setting is needed."""
  before = snapshot()
  activation = manager.install(STAGE, quiet=True)
  assert activation.installed and len(activation.hooks) == HOOKS
  assert vars(rl_program.StandardRLProgram)["train_stage"].__wrapped__ is newer_train_stage
  manager.uninstall("tunix", quiet=True)
  assert snapshot() == before


@pytest.mark.loop_way
@seam_only
def test_a_seam_of_another_shape_gets_nothing(clean, monkeypatch, capsys):
  async def _train_microbatches(self, engine, step, microbatches):  # trains nothing
    del self, engine, step, microbatches

  monkeypatch.setattr(rl_program.StandardRLProgram, "_train_microbatches", _train_microbatches)
  before = snapshot()
  assert not manager.install(STAGE).installed
  assert snapshot() == before
  (line,) = capsys.readouterr().err.strip().splitlines()
  assert line.endswith(
      "does not match (program: the train loop's seam (_step_microbatches, _train_microbatches): "
      "StandardRLProgram._train_microbatches does not call engine.train_step(..., "
      "accumulate_gradients=, apply_optimizer=) for each of microbatches.batches)"), line


def run_fresh(code, **env_updates):
  env = {k: v for k, v in os.environ.items() if not k.startswith("TUNIX_")}
  env.update(JAX_PLATFORMS="cpu", **env_updates)
  return subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env,
                        capture_output=True, text=True, timeout=120, check=True)


PROBE_PATCHED = ("import tunix.experimental.orchestrator.rl_program as p; "
                 "from tunix.experimental.worker import trainer_worker as t; "
                 "print(hasattr(t.TrainerWorker, 'stage_batch'), "
                 "'__tunix_stage_patched__' in vars(p.StandardRLProgram))")


@pytest.mark.loop_way
def test_bootstrap_installs_on_first_tunix_import_only_when_stage():
  on = run_fresh(PROBE_PATCHED, TUNIX_STAGE_BATCH="stage", TUNIX_MAX_STAGED_BATCHES="3")
  assert on.stdout.split() == ["True", "True"]
  lines = [l for l in on.stderr.splitlines() if l.startswith("tunix-stage:")]
  # The commit is named only where pip recorded one (a checkout, not an archive install).
  assert len(lines) == 1 and "staging on for tunix 0.1.8" in lines[0]
  assert f"{HOOKS} hooks" in lines[0] and "max_staged_batches=3" in lines[0]
  off = run_fresh(PROBE_PATCHED, TUNIX_STAGE_BATCH="off")
  assert off.stdout.split() == ["False", "False"]
  assert "tunix-stage" not in off.stderr
  unset = run_fresh(PROBE_PATCHED + "; import sys; "
                    "print('tunix_stage_plugin' in sys.modules)")
  assert unset.stdout.split()[-1] == "False" and "tunix-stage" not in unset.stderr


class Probe:
  """A non-trainer object served by tunix: its requests must stay on the loop, as upstream."""

  def where(self):
    return threading.current_thread().name


class ThreadTrainer:
  def fwd_bwd(self, payload, **kwargs):
    self.thread = threading.current_thread().name


def test_only_trainer_workers_are_routed(clean):
  manager.install(STAGE, quiet=True)
  worker = trainer_worker.TrainerWorker(ThreadTrainer)
  worker.initialize()

  async def main():
    probe = remote_execution.InProcessActorHandle(
        remote_execution.InProcessRemoteExecutionServer(Probe()))
    trainer = remote_execution.InProcessActorHandle(
        remote_execution.InProcessRemoteExecutionServer(worker))
    await trainer.asubmit("fwd_bwd", payload={"x": 1})
    health = await trainer.asubmit("heartbeat")
    return await probe.asubmit("where"), health

  where, health = asyncio.run(main())
  assert where == threading.current_thread().name  # unchanged: on the loop's thread
  assert worker._trainer.thread.startswith("trainer-compute")  # pylint: disable=protected-access
  assert health.state == datatypes.WorkerState.READY
