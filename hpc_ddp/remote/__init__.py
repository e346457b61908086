"""The laptop's side of `--ssh`: commands for a cluster reached over SSH. `ssh` (one shared connection and
ssh's failures in one line), `site` (host, remote folder and hpc-ddp from the flag and profile), `submit`
(ship the project, submit there, record the jobs here), `forward` (status, logs -f, cancel, ... of those
runs) and `argv` (parsed options back into words). Runs on the laptop only: imports point down to launch,
spec and common; nothing below imports it.
"""
