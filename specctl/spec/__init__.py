"""Speculative decoding in one process: drafters, lossless verification, the decode loop."""
