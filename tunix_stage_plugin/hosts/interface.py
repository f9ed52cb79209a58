"""The host adapter contract: how staging is hooked into one host.

An adapter is found through the `tunix_stage_plugin.hosts` entry-point group and must be cheap to
import: it names its host's modules and imports them only when asked to `load`. The activation
layer (tunix_stage_plugin.activation) drives it: load, probe every capability, and only if all
probes pass, apply the hooks through an exact-reversal registry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

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
