"""The fleet's one error kind: a user's impossible request, one line at the CLI (exit 2)."""

from kvlab.errors import KvlabError


class FleetError(KvlabError):
    """A workload, service model or calibration the simulator cannot run."""
