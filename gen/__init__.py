"""tilemarlin's generator: the `gen` CLI, the search loop, compiling and measuring."""
