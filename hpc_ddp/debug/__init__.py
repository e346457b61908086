"""Debugging a run (login node): `rerun` replays one attempt here, from the checkpoint it started from;
`attach` reaches a rank waiting for a debugger (--debug-rank)."""
