"""Paged KV cache: host-side page tables (pages.py) and the reference paged attention (reference.py)."""
