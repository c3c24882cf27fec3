"""Process plumbing shared by the server roles: the compute thread, TLS, the event loop."""
