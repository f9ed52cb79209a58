"""Host adapters: how staging is hooked into one host (tunix; MaxText's engine behind it).

The contract an adapter keeps is `interface.HostAdapter`; `triggers` names the built-in hosts'
modules. This package imports nothing: the env-gated bootstrap reads `triggers` at interpreter
start.
"""
