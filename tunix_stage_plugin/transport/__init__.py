"""The large-payload transport both hosts use: a call's header on the host's own gRPC call, its
arrays' bytes beside it on a plain TCP connection, received into pooled aligned buffers.

- frames: the header (method, protocol-5 pickle, buffer sizes, transfer id), its checks, chunks;
- bulk: the listener (frames matched with the calls that announced them) and the sender;
- calls: one call's header and bytes sent together, the header's answer deciding.

Production code (tunix's host loads it): it imports nothing from the lab. docs/design.md "Layout".
"""
