"""tunix host adapter: staging on TrainerWorker, a staged train loop on StandardRLProgram.

Importing this package does not import tunix: the activation layer calls `ADAPTER.load()` when it
installs. Which file does what, and a micro-batch's way through them: docs/design.md.
"""

from tunix_stage_plugin.hosts.placements import payload_transforms
from tunix_stage_plugin.hosts.placements import register_payload_transform
from tunix_stage_plugin.hosts.placements import unregister_payload_transform
from tunix_stage_plugin.hosts.tunix.adapter import ADAPTER
from tunix_stage_plugin.hosts.tunix.adapter import TunixAdapter
