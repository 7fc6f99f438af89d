"""Attention over the paged KV pool: the backend interface, per-step metadata, and the torch reference backend (with native CPU kernels)."""
