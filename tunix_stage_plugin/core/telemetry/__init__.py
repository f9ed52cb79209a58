"""What staging did in a job, measured by the job itself: per-step figures on each process.

Each process that stages (orchestrator, trainer) records spans of its own side of the path
(`recorder`): the trainer its receives, placements, buffer-pool waits and each computation's
device time; the orchestrator its stage calls and what each transport sent. Step aggregators
(`trainer`, `orchestrator`) turn them into one record per step (`record`: a versioned JSON-lines
schema), one compact line every N steps (`lines`), and `tunix-stage report` reads the records
back (`analysis`). With staging off nothing here is made. docs/observability.md.
"""
