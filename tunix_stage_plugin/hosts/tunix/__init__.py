"""tunix host adapter: stage_batch on TrainerWorker, a staged train loop on StandardRLProgram.

Importing this package does not import tunix: the activation layer calls `ADAPTER.load()` when
it installs. The hook modules (server, worker with peft and observation, engine, program with run,
loop_copy and loop_seam, and the transports' ends they use: route, side, stream) import tunix at
their top and are imported only from `ADAPTER.apply`; contract, chunked, lanes,
installation and sessions import no tunix. Which file does what: docs/design.md "Layout".
"""

from tunix_stage_plugin.hosts.tunix.adapter import ADAPTER
from tunix_stage_plugin.hosts.tunix.adapter import TunixAdapter
from tunix_stage_plugin.hosts.tunix.transforms import payload_transforms
from tunix_stage_plugin.hosts.tunix.transforms import register_payload_transform
from tunix_stage_plugin.hosts.tunix.transforms import unregister_payload_transform
