from nmt_cli.cli import main

main()
