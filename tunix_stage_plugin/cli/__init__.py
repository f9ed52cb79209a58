"""The `tunix-stage` console script."""
