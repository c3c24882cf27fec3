"""specctl's own decoder, KV cache and token tree."""
