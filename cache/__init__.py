"""Tuned tables that ship with tilemarlin (tuned/<gpu>.json); compiled kernels go to kernels/ (ignored)."""
