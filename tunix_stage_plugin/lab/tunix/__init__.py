"""The tunix host in the lab: as a bench host, trainer node processes of tunix's own classes
(node.py) and the orchestrator that drives them with tunix's train loop (bench.py), docs/bench.md
"Hosts"; and a small tunix job for tunix's runtime (job.py), which `local_launcher.sh --host
tunix` runs, docs/launching.md "A tunix job on this machine"."""
