from hpc_ddp.cli import main

main()
