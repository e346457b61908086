"""`make bench`: hpc-ddp against plain alternatives, side by side in one run (see bench/README.md)."""
