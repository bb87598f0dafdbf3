"""Per-node agent of Denpex: reads rank logs, matches failure signatures, ships events.

The reader, the rule model and the event type live here and are reused by the daemon's
post-mortem path; this package never imports the daemon.
"""

__version__ = "0.1.0"
