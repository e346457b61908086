"""Runs inside every training process: the Session API, crash-safe checkpoints, rendezvous, and the built-in trainer."""
