"""The tunix host as a bench host: trainer node processes of tunix's own classes (node.py) and
the orchestrator that drives them with tunix's train loop (bench.py). docs/bench.md "Hosts"."""
