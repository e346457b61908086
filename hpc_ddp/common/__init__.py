"""Shared by every runtime: errors, exit codes, the run-dir layout, JSON-lines records, durable writes, secrets, subprocesses."""
