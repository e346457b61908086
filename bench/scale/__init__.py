"""The scale simulation (`make scale`): hpc-ddp's launcher-side paths run at up to 256 nodes x 8 ranks on
one machine, with real files and a real TCPStore. See bench/scale_sim.py and bench/README.md, "Scale"."""
