"""Wire protocol and framing shared by every role."""
