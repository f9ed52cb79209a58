"""What staging did in a job, measured by the job itself: per-step figures on each process.

Each staging process records spans of its own side of the path (`recorder`); step aggregators
(`trainer`, `orchestrator`) turn them into one record per step (`record`) and one compact line every
N steps (`lines`); `tunix-stage report` reads the records back (`analysis`). With staging off
nothing here is made. docs/observability.md.
"""
