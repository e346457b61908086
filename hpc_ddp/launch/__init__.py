"""Runs on the login node: plan and submit (executors, script rendering, preflight), then watch (status, registry, timeline, plots)."""
