"""The large-payload transport both hosts use: a call's header on the host's own call, its
arrays' bytes beside it on a plain TCP connection, received into pooled aligned buffers.
`wire` (a call encoded out of band, the bulk format and the channel's frame), `listener` (the
trainer's end), `sender` (the orchestrator's), `stream` (the chunked stream, both ends, loaded on
its first call). Production code: it imports nothing from the lab. docs/design.md "Layout".
"""
