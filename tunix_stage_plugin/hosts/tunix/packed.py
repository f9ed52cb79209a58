"""The type of a staged payload whose large arrays travel compressed (TUNIX_STAGE_CODEC), apart
from the codec itself (compression.py over core/codec.py), so that a trainer loads the codec only
when such a payload arrives and an orchestrator only where a codec is set. docs/codec.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class CompressedPayload:
  """A payload's pytree with its large array leaves as core.codec.PackedArray."""

  codec: str  # codec.Codec.name
  tree: Any
  nbytes: int  # the array leaves' bytes once decoded
  wire_bytes: int  # the array leaves' bytes as they travel
