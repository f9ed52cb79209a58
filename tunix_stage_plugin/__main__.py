"""`python -m tunix_stage_plugin ...` is `tunix-stage ...` (for a Python whose scripts are not on PATH)."""

import sys

from tunix_stage_plugin.cli import main

if __name__ == "__main__":
  sys.exit(main.main())
