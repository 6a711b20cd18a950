"""The one error type for bad planner input: the CLI turns it into a one-line message and exit 2."""


class PlanError(ValueError):
    """A user mistake (bad name, bad number, malformed file), never a bug."""
