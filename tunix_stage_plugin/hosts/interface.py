"""The contracts a host implements: its adapter (how staging is hooked into it) and a placement
(how one kind of trainer behind it is staged: hosts/placements.py). Typing only: nothing imports
this module at run time.

An adapter is found through the `tunix_stage_plugin.hosts` entry-point group and must be cheap to
import: it names its host's modules and imports them only when asked to `load`. The activation
layer (tunix_stage_plugin.activation) drives it: load, probe every capability, and only if all
probes pass, apply the hooks through an exact-reversal registry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ContextManager, Protocol

if TYPE_CHECKING:  # the activation layer imports the hosts, not the other way round
  from tunix_stage_plugin.core import patching
  from tunix_stage_plugin.core import config as config_lib
  from tunix_stage_plugin.hosts.probing import Probe


class HostAdapter(Protocol):
  name: str
  # Importing any of these (when the env-gated bootstrap is active) triggers install.
  trigger_modules: tuple[str, ...]
  # One line per hook group, for reports before anything is installed.
  hook_groups: tuple[str, ...]

  def load(self) -> None:
    """Imports the host modules the hooks patch; raises ImportError when the host is absent."""

  def describe(self) -> str:
    """Host name, version and commit, e.g. 'tunix 0.1.8 (commit c7d8950)'."""

  def probe(self, config: "config_lib.StageConfig") -> list[Probe]:
    """Checks every capability the hooks need, with the settings that bear on it (e.g. a changed
    host method a setting accepts); must not change anything."""

  def apply(self, registry: "patching.PatchRegistry", live: "config_lib.LiveConfig") -> None:
    """Sets the hooks through `registry` (so uninstall can reverse them exactly); the hooks read
    their settings from `live`, which a re-install updates."""


class Placement(Protocol):
  name: str
  host: str  # the host the telemetry names for this kind's computations
  seam: str  # the name of the trainer's preparation method staging goes through
  # Raises for a payload this kind of trainer can never stage (refused before any wait); None
  # where no payload can be told unstageable before its preparation runs (a failure there is a
  # failed stage, trained inline).
  check: Callable[[Any], None] | None

  def find(self, owner: Any) -> tuple[Any, str | None]:
    """For `owner`, the object whose seam a trainer's calls reach: (target, None) to stage
    through it; (None, reason) when this kind can never stage it; (None, None): not this kind."""

  def place(self, target: Any, payload: Any) -> Any:
    """On the placer thread: prepare and place `payload`; blocks until the copy is done."""

  def resolve(self, target: Any, staged: Any) -> tuple[Any, str | None]:
    """In the seam, consuming `staged` (what `place` returned): what the preparation returns, and
    why it was prepared from the payload instead (None: the placed batch as it is)."""

  def computation(self, target: Any, kind: str) -> Any:
    """Right after `target`'s fwd_bwd or update (`kind`) returned, on the same thread: an output
    of the computation it queued, ready once that computation ended; None where there is none."""

  def tracer(self, target: Any) -> Any:
    """`target`'s tunix PerfTracer, where it has one; else None."""

  def computation_span(self, tracer: Any, target: Any) -> ContextManager[Callable[[], None]]:
    """Around one fwd_bwd or update where `tracer` (what `tracer` answered) is one: its span on
    the tracer; yields what ends its device span once the computation's output is ready."""

  def metrics_logger(self, target: Any) -> Any:
    """What `target` logs its metrics with, where it has one; else None."""

  def step_sink(self, target: Any, logger: Any) -> Any:
    """The step sink that logs each trainer step's scalars through `logger` at the step
    `target` logs its loss at."""
