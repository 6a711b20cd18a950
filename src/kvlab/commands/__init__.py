"""One module per `kvlab` sub-command: each has `add_parser(subparsers, name, help)` and sets `run`."""
