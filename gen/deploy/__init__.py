"""Deployment: `gen precompile` builds ahead of time every kernel a model's layers will run."""
