"""The `pdmesh` command: argparse front end; each subcommand parses, calls a library function,
prints."""
