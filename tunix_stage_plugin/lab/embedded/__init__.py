"""Embedded default host: a JAX trainer served over real gRPC on 127.0.0.1, and its orchestrator.

Layers, one file per idea:

- data: model/payload sizes and deterministic micro-batches (numpy only, both processes).
- wire, pacing: how calls travel (pickled header + out-of-band array bytes in ~4 MiB chunks) and
  the emulated link bandwidth.
- server, client: the generic method-call gRPC service and its async client.
- trainer (JAX, trainer process only), worker: the served object on core.executor lanes with
  core.store for staged batches.
- engine, job: the orchestrator side: a core.pipeline.StageEngine and the step loop.
- process, trainer_main, orchestrator_main: process entry points.

Only trainer.py imports JAX; the orchestrator side never does.
"""
