"""Watching runs (login node): status and logs, the registry of this user's runs, where the time went
(timeline), plots, and why a run failed."""
