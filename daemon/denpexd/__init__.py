"""The Denpex correlator: post-mortem `diagnose`, and (live) `serve` and `query`."""

__version__ = "0.1.0"
