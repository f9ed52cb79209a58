"""tunix-stage-plugin: stage tunix's training micro-batches on the device ahead of their turn.

Importing this package changes nothing in any host; see README.md for how staging is switched on.
"""

__version__ = "0.1.0"
