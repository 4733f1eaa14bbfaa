"""gen tune: search, check and time candidates per layer and M bucket; the tuned tables."""
