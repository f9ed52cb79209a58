"""MaxText host adapter: stage micro-batches into MaxText's training engine behind tunix's
TrainerWorker (docs/maxtext.md).

Importing this package does not import MaxText: the activation layer calls `ADAPTER.load()`.
"""

from tunix_stage_plugin.hosts.maxtext.adapter import ADAPTER
from tunix_stage_plugin.hosts.maxtext.adapter import MaxTextAdapter
