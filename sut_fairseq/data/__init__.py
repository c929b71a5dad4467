"""Data generation and preparation helpers (standard library only; no torch, no fairseq)."""
