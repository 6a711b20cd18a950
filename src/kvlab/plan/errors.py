"""The error type for bad planner input: the CLI turns it into a one-line message and exit 2."""

from kvlab.errors import KvlabError


class PlanError(KvlabError):
    """A user mistake (bad name, bad number, malformed file), never a bug."""
