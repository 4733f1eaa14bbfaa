"""tilemarlin's runtime: tuned tables, compiled-kernel lookup and the torch-facing linear op."""
