"""The version of tiered (also written into every saved cache's manifest)."""

__version__ = "0.1.0"
