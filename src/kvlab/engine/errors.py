"""The engine's user errors: a bad request (HTTP 400) and a full queue (HTTP 503)."""

from kvlab.errors import KvlabError


class RequestError(KvlabError):
    """A request the engine refuses as asked: bad sampling values, a prompt that can never fit."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineOverloaded(KvlabError):
    """More requests wait than --max-waiting-requests allows: come back later (HTTP 503)."""
