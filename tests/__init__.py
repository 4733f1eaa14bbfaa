"""tilemarlin's tests; a package, so that a test can import another's helpers as `tests.<module>`."""
