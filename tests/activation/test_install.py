"""Activation: install / uninstall through an exact-reversal registry, idempotent, probed first.

The host here is a fake defined in this module: it stands in for tunix's classes because tunix's
experimental stack cannot be installed in CI. The same checks against the real classes are in
tests/hosts/tunix/test_activation.py (marked `tunix`).
"""

from __future__ import annotations

import pytest

import tunix_stage_plugin
from tunix_stage_plugin.activation import entry_points
from tunix_stage_plugin.activation import manager
from tunix_stage_plugin.activation import native
from tunix_stage_plugin.core import patching
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.hosts.probing import Probe

STAGE = {"TUNIX_STAGE_BATCH": "stage"}


class FakeBase:
  def inherited(self):
    return "host inherited"


class FakeWorker(FakeBase):
  def fwd_bwd(self, payload, **kwargs):
    return ("host fwd_bwd", payload, kwargs)


class FakeEngine:
  def train_step(self, payload, **kwargs):
    return "host train_step"


def staged_fwd_bwd(self, *args, **kwargs):
  return "hooked fwd_bwd"


def stage_batch(self, payload, key):
  return "hooked stage_batch"


def hooked_inherited(self):
  return "hooked inherited"


def snapshot():
  return {cls: dict(cls.__dict__) for cls in (FakeBase, FakeWorker, FakeEngine)}


class FakeAdapter:
  name = "fake"
  trigger_modules = ("fake_host_module",)
  hook_groups = ("worker: fake hooks",)

  def __init__(self, *, probe_ok=True, importable=True, fail_apply=False):
    self.probe_ok = probe_ok
    self.importable = importable
    self.fail_apply = fail_apply
    self.applied = 0

  def load(self):
    if not self.importable:
      raise ModuleNotFoundError("No module named 'fake_host'")

  def describe(self):
    return "fakehost 1.2 (commit abcdef0)"

  def probe(self, config):
    return [Probe("worker: FakeWorker.fwd_bwd", True),
            Probe("engine: FakeEngine.train_step", self.probe_ok, "train_step lacks **kwargs")]

  def apply(self, registry, config):
    self.applied += 1
    registry.set(FakeWorker, "fwd_bwd", staged_fwd_bwd)  # own attribute: restored
    registry.set(FakeWorker, "stage_batch", stage_batch)  # new attribute: deleted again
    registry.set(FakeWorker, "inherited", hooked_inherited)  # shadows the base's: deleted again
    if self.fail_apply:
      raise RuntimeError("boom while patching")
    registry.set(FakeEngine, "stage_train_batch", stage_batch)


@pytest.fixture
def adapter(monkeypatch):
  fake = FakeAdapter()
  monkeypatch.setattr(entry_points, "load_adapter",
                      lambda name: fake if name == "fake" else entry_points.load_adapter(name))
  yield fake
  manager.uninstall("fake", quiet=True)


def stage_config(**explicit):
  return config_lib.resolve({"mode": "stage", **explicit}, env={})


def test_install_patches_and_uninstall_restores_class_dicts_exactly(adapter, capsys):
  before = snapshot()
  activation = manager.install(stage_config(max_staged_batches=3), host="fake")
  assert activation.installed
  assert FakeWorker().fwd_bwd(1) == "hooked fwd_bwd"
  assert FakeWorker().inherited() == "hooked inherited"
  assert FakeWorker.__dict__[patching.SENTINEL] is True
  assert activation.hooks == [
      f"{__name__}.FakeWorker.fwd_bwd", f"{__name__}.FakeWorker.stage_batch",
      f"{__name__}.FakeWorker.inherited", f"{__name__}.FakeEngine.stage_train_batch"]
  err = capsys.readouterr().err.splitlines()
  assert err == [activation.line]
  assert "fakehost 1.2 (commit abcdef0)" in err[0] and "4 hooks" in err[0]
  assert "max_staged_batches=3" in err[0] and "max_device_batches=1" in err[0]

  assert manager.uninstall("fake", quiet=True) == ["fake"]
  assert snapshot() == before
  assert FakeWorker().fwd_bwd(1) == ("host fwd_bwd", 1, {})
  assert FakeWorker.__dict__["fwd_bwd"] is before[FakeWorker]["fwd_bwd"]


def test_install_is_idempotent_and_updates_depths(adapter, capsys):
  manager.install(stage_config(), host="fake")
  patched = snapshot()
  again = manager.install(stage_config(max_staged_batches=4), host="fake")
  assert again.installed and adapter.applied == 1
  assert snapshot() == patched
  assert manager.current_config("fake").max_staged_batches == 4
  err = capsys.readouterr().err.splitlines()
  assert len(err) == 2 and err[0].startswith("tunix-stage: staging on for fakehost")
  # The second call changed a depth: one line says what is in force now and where it came from.
  assert err[1] == ("tunix-stage: staging settings now in force for fake: max_staged_batches=4 "
                    "(--max_staged_batches), max_device_batches=1, max_host_batches=auto, "
                    "codec=off "
                    "[--stage_train_batches=stage]")
  manager.install(stage_config(max_staged_batches=4), host="fake")
  assert capsys.readouterr().err == ""  # the same settings again: nothing to say


def test_reinstall_after_uninstall_is_exact_again(adapter):
  before = snapshot()
  for _ in range(3):
    manager.install(stage_config(), host="fake", quiet=True)
    assert manager.is_installed("fake")
    manager.uninstall("fake", quiet=True)
    assert snapshot() == before
  assert not manager.is_installed("fake") and manager.installed_hooks("fake") == []


def test_mode_off_installs_nothing_and_says_so(adapter, capsys):
  before = snapshot()
  activation = manager.install(config_lib.resolve(env={}), host="fake")
  assert not activation.installed and snapshot() == before and adapter.applied == 0
  assert capsys.readouterr().err.strip() == (
      "tunix-stage: staging is off (default=off); nothing installed")


def test_mode_off_measures_and_writes_nothing_even_with_a_metrics_folder(adapter, capsys,
                                                                          tmp_path):
  """Off means off: the telemetry settings are read, but no folder, record or per-step line
  comes of them."""
  folder = tmp_path / "metrics"
  activation = manager.install(config_lib.resolve({"metrics": str(folder), "log_every": 1},
                                                  env={}), host="fake")
  assert not activation.installed and adapter.applied == 0
  assert not folder.exists()
  assert capsys.readouterr().err.strip() == (
      "tunix-stage: staging is off (default=off); nothing installed")


def test_mode_off_from_env_is_named(adapter, capsys, monkeypatch):
  monkeypatch.setenv("TUNIX_STAGE_BATCH", "off")
  assert not manager.install(host="fake").installed
  assert "(TUNIX_STAGE_BATCH=off)" in capsys.readouterr().err


def test_failed_probe_installs_nothing_with_one_line(adapter, capsys):
  adapter.probe_ok = False
  before = snapshot()
  activation = manager.install(stage_config(), host="fake")
  assert not activation.installed and snapshot() == before and adapter.applied == 0
  err = capsys.readouterr().err.splitlines()
  assert err == ["tunix-stage: fakehost 1.2 (commit abcdef0) does not match (engine: "
                 "FakeEngine.train_step: train_step lacks **kwargs)"]


def test_absent_host_installs_nothing(adapter, capsys):
  adapter.importable = False
  assert not manager.install(stage_config(), host="fake").installed
  assert capsys.readouterr().err.strip() == (
      "tunix-stage: fake is not importable (ModuleNotFoundError: No module named 'fake_host')")


def test_failure_while_patching_reverts_everything(adapter, capsys):
  adapter.fail_apply = True
  before = snapshot()
  assert not manager.install(stage_config(), host="fake").installed
  assert snapshot() == before and not manager.is_installed("fake")
  assert "applying hooks failed, all reverted: RuntimeError: boom" in capsys.readouterr().err


def test_invalid_env_value_raises_and_installs_nothing(adapter, capsys, monkeypatch):
  monkeypatch.setenv("TUNIX_STAGE_BATCH", "stage")
  monkeypatch.setenv("TUNIX_MAX_STAGED_BATCHES", "0")
  before = snapshot()
  with pytest.raises(config_lib.ConfigError, match="TUNIX_MAX_STAGED_BATCHES='0' is invalid"):
    manager.install(host="fake")
  assert snapshot() == before and adapter.applied == 0 and not manager.is_installed("fake")
  assert capsys.readouterr().err == ""


@pytest.mark.parametrize("env", [
    {"TUNIX_STAGE_BATCH": "on"},  # a typo of "stage": refused, not taken as off
    {"TUNIX_STAGE_BATCH": "stage", "TUNIX_MAX_STAGED_BATCHES": "0"},
])
def test_activate_from_env_stops_the_process_on_an_invalid_setting(adapter, capsys, monkeypatch,
                                                                   env):
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  before = snapshot()
  with pytest.raises(SystemExit) as e:
    manager.activate_from_env("fake")
  assert e.value.code == 2 and snapshot() == before and adapter.applied == 0
  (name, value), = [(k, v) for k, v in env.items() if v != "stage"]
  accepted = ("off | stage" if name == "TUNIX_STAGE_BATCH"
              else "auto, or an integer >= 1 and <= 1024")
  assert capsys.readouterr().err.splitlines() == [
      f"tunix-stage: error: invalid staging configuration: {name}={value!r} is invalid; "
      f"accepted: {accepted}"]


def test_activate_from_env_is_silent_when_off_and_installs_when_on(adapter, capsys, monkeypatch):
  monkeypatch.setenv("TUNIX_STAGE_BATCH", "off")
  assert manager.activate_from_env("fake") is None and adapter.applied == 0
  assert capsys.readouterr().err == ""
  monkeypatch.setenv("TUNIX_STAGE_BATCH", "stage")
  assert manager.activate_from_env("fake").installed and adapter.applied == 1


def test_unknown_host_names_the_registered_ones(capsys):
  assert not manager.install(stage_config(), host="nohost").installed
  err = capsys.readouterr().err
  assert "no host adapter 'nohost'" in err and "'tunix'" in err


def test_uninstall_leaves_a_hook_someone_replaced_and_says_so(adapter, capsys):
  manager.install(stage_config(), host="fake", quiet=True)

  def theirs(self):
    return "theirs"

  FakeWorker.stage_batch = theirs
  try:
    manager.uninstall("fake", quiet=True)
    assert FakeWorker.__dict__["stage_batch"] is theirs
    assert "FakeWorker.stage_batch was replaced after install; left as found" in (
        capsys.readouterr().err)
    assert "fwd_bwd" in FakeWorker.__dict__ and FakeWorker().fwd_bwd(2)[0] == "host fwd_bwd"
  finally:
    del FakeWorker.stage_batch


def test_current_config_needs_an_install():
  with pytest.raises(RuntimeError, match="not installed"):
    manager.current_config("fake")


def test_package_level_install_and_uninstall_delegate(adapter):
  before = snapshot()
  assert tunix_stage_plugin.install(stage_config(), host="fake", quiet=True).installed
  assert tunix_stage_plugin.uninstall("fake", quiet=True) == ["fake"]
  assert snapshot() == before


def test_configure_follows_driver_flags_over_the_environment(adapter, capsys):
  before = snapshot()
  manager.install(stage_config(), host="fake", quiet=True)  # as the bootstrap would, from env
  updated = manager.configure(stage_config(max_staged_batches=5), host="fake", quiet=True)
  assert updated.installed and manager.current_config("fake").max_staged_batches == 5
  off = config_lib.resolve({"mode": "off"}, env={"TUNIX_STAGE_BATCH": "stage"},
                           explicit_source="flag")
  removed = manager.configure(off, host="fake")
  assert not removed.installed and snapshot() == before
  assert capsys.readouterr().err.strip() == (
      "tunix-stage: staging is off (--stage_train_batches=off); hooks removed")
  assert not manager.configure(off, host="fake", quiet=True).installed  # already off: no-op


def test_native_entry_point_is_silent_when_off(monkeypatch, capsys):
  calls = []
  monkeypatch.setattr(manager, "install", lambda *a, **k: calls.append((a, k)))
  monkeypatch.delenv("TUNIX_STAGE_BATCH", raising=False)
  native.activate()
  assert calls == [] and capsys.readouterr().err == ""
  monkeypatch.setenv("TUNIX_STAGE_BATCH", "stage")
  native.activate()
  assert len(calls) == 1 and calls[0][1] == {"host": "tunix"} and calls[0][0][0].enabled


def test_native_entry_point_stops_on_an_invalid_setting(monkeypatch, capsys):
  monkeypatch.setattr(manager, "install", lambda *a, **k: pytest.fail("must not install"))
  monkeypatch.setenv("TUNIX_STAGE_BATCH", "on")
  with pytest.raises(SystemExit) as e:
    native.activate()
  assert e.value.code == 2
  assert capsys.readouterr().err == ("tunix-stage: error: invalid staging configuration: "
                                     "TUNIX_STAGE_BATCH='on' is invalid; accepted: off | stage\n")


def test_registry_refuses_a_double_patch_and_undoes_in_reverse():
  registry = patching.PatchRegistry()
  before = snapshot()
  registry.set(FakeWorker, "fwd_bwd", staged_fwd_bwd)
  with pytest.raises(RuntimeError, match="already patched"):
    registry.set(FakeWorker, "fwd_bwd", stage_batch)
  registry.set(FakeEngine, "train_step", stage_batch)
  assert registry.names() == [f"{__name__}.FakeWorker.fwd_bwd",
                              f"{__name__}.FakeEngine.train_step"]
  assert registry.undo() == []
  assert snapshot() == before and len(registry) == 0


def test_install_takes_explicit_settings_over_the_environment(adapter, capsys, monkeypatch):
  monkeypatch.setenv("TUNIX_STAGE_BATCH", "off")
  monkeypatch.setenv("TUNIX_MAX_STAGED_BATCHES", "3")
  monkeypatch.setenv("TUNIX_STAGE_MAX_DEVICE_BATCHES", "2")
  activation = tunix_stage_plugin.install(host="fake", mode="stage", max_staged_batches=4)
  assert activation.installed
  cfg = manager.current_config("fake")
  assert (cfg.max_staged_batches, cfg.max_device_batches) == (4, 2)  # explicit > env
  assert (cfg.sources["max_staged_batches"], cfg.sources["max_device_batches"]) == (
      config_lib.SOURCE_INSTALL, config_lib.SOURCE_ENV)
  # A driver's resolution (flags + env) keeps what install() was told, flags still beating it.
  flags = config_lib.resolve({"max_device_batches": 3}, explicit_source="flag")
  manager.configure(flags, host="fake", quiet=True)
  cfg = manager.current_config("fake")
  assert (cfg.enabled, cfg.max_staged_batches, cfg.max_device_batches) == (True, 4, 3)


def test_install_refuses_bad_or_unknown_settings_before_patching(adapter):
  before = snapshot()
  with pytest.raises(config_lib.ConfigError, match=r"install\(max_staged_batches\)='0' is invalid"):
    manager.install(host="fake", mode="stage", max_staged_batches=0)
  with pytest.raises(config_lib.ConfigError, match=r"unknown staging setting\(s\) \['depth'\]"):
    manager.install(host="fake", depth=2)
  with pytest.raises(TypeError, match="a config or settings"):
    manager.install(stage_config(), host="fake", max_staged_batches=2)
  assert snapshot() == before and adapter.applied == 0
