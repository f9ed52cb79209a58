"""The large-payload transport both hosts use: a call's header on the host's own call, its
arrays' bytes beside it on a plain TCP connection, received into pooled aligned buffers.

- request: a call encoded out of band (the pickle and the arrays' own memory, no copy), decoded
  over the buffers its bytes were received into;
- frames: the one bulk format every carrier takes (the call's header, its chunks, the cap check,
  WireError) and the bulk channel's frame, first byte and limits;
- listener: the trainer's end (frames matched with the calls that announced them);
- sender: the orchestrator's end (leased connections; a call's header and bytes sent together).

Production code (tunix's host loads it): it imports nothing from the lab. docs/design.md "Layout".
"""
