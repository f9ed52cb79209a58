"""The state of one tunix installation, kept outside tunix's objects and closed with it.

Every process gets the hooks (hooks.py); each role's machinery is made on its first call, so a
process loads only the role it plays. A process that serves tunix's workers makes the trainer's
side (trainer.py: the lanes, receive pool, side channels and each worker's staged batches); one
that drives a DistributedRLEngine makes the orchestrator's (orchestrator.py: each trainer's
connection). Uninstall closes both: every lane, listener and connection, every staged batch
dropped. docs/design.md "Layout".
"""

from __future__ import annotations

import threading
from typing import Any

from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import patching
from tunix_stage_plugin.core.telemetry import process as telemetry_lib
from tunix_stage_plugin.transport import wire

# The most one chunked or side-channel call may announce; a header announcing more is refused
# before any of its bytes is read. Far above a production micro-batch (5 GB), far below what a
# corrupt header could claim.
MAX_STREAM_BYTES = 64 << 30
HOST = "tunix"  # the host the records name (a trainer's own kind, e.g. maxtext, where it has one)


class Installation:
  """What the hooks of one installation share: the settings, the process's telemetry, and each
  role's side, made on its first call (`trainer_side`, `orchestrator_side`)."""

  def __init__(self, live: config_lib.LiveConfig, modules: Any,
               registry: patching.PatchRegistry) -> None:
    self.live = live
    self.modules = modules  # the tunix modules the hooks patch (adapter.Modules)
    self.registry = registry  # where a trainer's own seam is set on first use (undone with it)
    self.host_execute: Any = None  # tunix's own execute_request, for calls off the lanes
    self._lock = threading.Lock()
    self._said: set[str] = set()  # the once-per-installation log lines already said
    self.telemetry = telemetry_lib.Telemetry(telemetry_lib.Settings.of(HOST, live.config))
    self.recorder = self.telemetry.recorder
    # Whether servers started from now on get a bulk side channel (tests serve without one), the
    # bounds its listener holds a peer to, and the cap on one bulk call.
    self.serve_side_channel = True
    self.bulk_limits = wire.BulkLimits()
    self.max_stream_bytes = MAX_STREAM_BYTES
    self.trainer: Any = None  # trainer.TrainerSide, once made
    self.orchestrator: Any = None  # orchestrator.OrchestratorSide, once made
    live.on_update(self._reconfigure)

  def trainer_side(self) -> Any:
    """The trainer's side, made on the first call a server of this process serves."""
    with self._lock:
      if self.trainer is None:
        # pylint: disable-next=import-outside-toplevel  (a process that only orchestrates: never)
        from tunix_stage_plugin.hosts.tunix import trainer
        self.trainer = trainer.TrainerSide(self)
      return self.trainer

  def orchestrator_side(self) -> Any:
    """The orchestrator's side, made on the first call an engine of this process sends."""
    with self._lock:
      if self.orchestrator is None:
        # pylint: disable-next=import-outside-toplevel  (a process that only trains: never)
        from tunix_stage_plugin.hosts.tunix import orchestrator
        self.orchestrator = orchestrator.OrchestratorSide(self)
      return self.orchestrator

  def first_time(self, what: str) -> bool:
    """True the first time `what` is asked about in this installation (a line said once)."""
    with self._lock:
      if what in self._said:
        return False
      self._said.add(what)
      return True

  def drain(self, timeout: float | None = None) -> bool:
    """Waits until every computation dispatched so far is recorded (a bench between its runs)."""
    return self.trainer is None or self.trainer.drain(timeout)

  def _reconfigure(self, config: config_lib.StageConfig) -> None:
    self.telemetry.configure(telemetry_lib.Settings.of(HOST, config))
    if self.trainer is not None:
      self.trainer.reconfigure(config)

  def close(self) -> None:
    """Closes both sides (the hooks are going away) and the telemetry."""
    with self._lock:
      trainer, self.trainer = self.trainer, None
      orchestrator, self.orchestrator = self.orchestrator, None
    if orchestrator is not None:
      orchestrator.close()
    if trainer is not None:
      trainer.close()
    self.telemetry.close()
