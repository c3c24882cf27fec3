"""A target instance: verifies proposals and owns its sessions' decode loops."""
