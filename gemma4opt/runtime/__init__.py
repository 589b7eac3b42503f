"""Per-step runtime state (the paged KV step context)."""
