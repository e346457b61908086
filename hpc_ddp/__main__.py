from hpc_ddp.cli.main import main

main()
