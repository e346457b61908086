"""The `hpc-ddp` command (runs on the login node): thin command groups over the modules that own the logic."""
