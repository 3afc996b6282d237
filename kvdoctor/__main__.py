from kvdoctor.cli.app import main

main()
