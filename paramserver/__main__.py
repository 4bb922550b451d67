from paramserver.cli import main

main()
