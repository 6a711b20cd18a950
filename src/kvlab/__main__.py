"""`python -m kvlab` is the `kvlab` command."""

from kvlab.cli import main

raise SystemExit(main())
