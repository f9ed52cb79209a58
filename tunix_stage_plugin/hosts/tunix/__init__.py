"""tunix host adapter: staging on TrainerWorker, a staged train loop on StandardRLProgram.

Importing this package does not import tunix: the activation layer calls `ADAPTER.load()` when it
installs. Which file does what, and a micro-batch's way through them: docs/design.md.
`register_payload_transform(fn)` (and `unregister_payload_transform`, `payload_transforms`) is
hosts/placements.py's, here for a trainer's own code: docs/tunix.md.
"""

from typing import Any

from tunix_stage_plugin.hosts.tunix.adapter import ADAPTER
from tunix_stage_plugin.hosts.tunix.adapter import TunixAdapter

_TRANSFORMS = ("register_payload_transform", "unregister_payload_transform", "payload_transforms")


def __getattr__(name: str) -> Any:
  """The payload transforms' registry, loaded where it is used (a trainer), not with the hooks."""
  if name in _TRANSFORMS:
    from tunix_stage_plugin.hosts import placements  # pylint: disable=import-outside-toplevel
    return getattr(placements, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
