"""specctl: distributed speculative decoding runtime."""

__version__ = "0.1.0"
