"""Deployment: `gen precompile` builds ahead of time every kernel a model's layers will run, and `gen export`
packs a model's tuned entries and kernels into one artifact for serving machines (runtime/artifact.py)."""
