"""What a codec spec (TUNIX_STAGE_CODEC's value) may name: the codecs, their levels and defaults.

A module of its own, without numpy, so that core.config (read by every `tunix-stage` command and
by the bootstrap) can say what it accepts, levels included, without importing core/codec.py's
numpy. core/codec.py re-exports every name here (`codec.LEVELS` is this table). docs/codec.md
and docs/configuration.md.
"""

from __future__ import annotations

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
