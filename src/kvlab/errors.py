"""kvlab's two kinds of failure, stdlib only so every layer (the planner too) can raise them.

`KvlabError` is a user's mistake (a bad name, number, file or request): the CLI prints it as
one line and exits 2, the server answers 400. `KvlabEnvironmentError` is this machine failing
kvlab (a C kernel build that breaks): one line too, exit 1, since no flag of the user's fixes it.
"""


class KvlabError(ValueError):
    """A user mistake, never a bug: shown as one line, never a traceback."""


class KvlabEnvironmentError(RuntimeError):
    """The machine cannot do what kvlab needs (a compiler that fails): shown as one line, exit 1."""
