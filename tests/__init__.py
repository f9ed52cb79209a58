"""Tests for tunix_stage_plugin, laid out like the package (helpers import as tests.<area>.<module>)."""
