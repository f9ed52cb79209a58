"""The large-payload transport both hosts use: a call's header on the host's own call, its
arrays' bytes beside it on a plain TCP connection, received into pooled aligned buffers.

- frames: what both ends agree on (the call's header, the frame, the connection's first byte,
  the limits);
- listener: the trainer's end (frames matched with the calls that announced them);
- sender: the orchestrator's end (leased connections; a call's header and bytes sent together).

Production code (tunix's host loads it): it imports nothing from the lab. docs/design.md "Layout".
"""
