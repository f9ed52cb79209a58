"""What a codec spec (TUNIX_STAGE_CODEC's value) may name, and what a compressed payload is.

A module of its own, without numpy, so that core.config (read by every `tunix-stage` command and
by the bootstrap) can say what it accepts, levels included, and a trainer can tell a compressed
payload, without importing core/codec.py: the codec loads only where one is set or such a
payload arrives. core/codec.py re-exports every name here. docs/codec.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

OFF = "off"
ON = "on"  # the default codec at its default level (docs/codec.md)
DEFAULT_CODEC = "blosc2-zstd"
# One library, blosc2, carries both: its zstd had the best ratio at the best speed, its lz4 the
# fastest decode; standalone zstandard and lz4 were slower at a lower ratio (docs/codec.md).
CODECS = ("blosc2-zstd", "blosc2-lz4")
DEFAULT_LEVELS = {"blosc2-zstd": 1, "blosc2-lz4": 5}
LEVELS = {"blosc2-zstd": (0, 9), "blosc2-lz4": (0, 9)}
MODULES = {"blosc2-zstd": "blosc2", "blosc2-lz4": "blosc2"}
EXTRA_NAME = "codec"  # the package's extra that installs the codec libraries
EXTRA = f"the '{EXTRA_NAME}' extra"  # how messages name it (core.codec.extra_hint adds the command)
ACCEPTED = (f"{OFF} | {ON} (= {DEFAULT_CODEC}:{DEFAULT_LEVELS[DEFAULT_CODEC]}) | NAME[:LEVEL] "
            "with LEVEL an integer in NAME's range: "
            + ", ".join(f"{name} {LEVELS[name][0]} to {LEVELS[name][1]} (default "
                        f"{DEFAULT_LEVELS[name]})" for name in CODECS))


class CodecUnavailable(ValueError):
  """The spec is well formed but its library is not installed (the message names the extra)."""


@dataclasses.dataclass
class CompressedPayload:
  """A staged payload's pytree with its large array leaves as core.codec.PackedArray."""

  codec: str  # codec.Codec.name
  tree: Any
  nbytes: int  # the array leaves' bytes once decoded
  wire_bytes: int  # the array leaves' bytes as they travel
