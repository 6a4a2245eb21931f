"""The engine's exception hierarchy.

Every error the engine raises on purpose derives from ``EngineError``; the server (later) maps
these classes, and only these, to HTTP statuses. Anything else escaping the engine is a bug.

- ``InvalidRequestError``: the request itself is wrong (bad sampling parameters, a prompt the
  model cannot take); submitting it again unchanged will fail again.
- ``RequestTooLargeError``: prompt plus ``max_tokens`` can never fit the KV pool or the model's
  context, however idle the engine is.
- ``ModelLoadError``: a model directory is missing a file, names an unsupported architecture or
  holds weights that do not match its config.
- ``EngineDeadError``: the step loop has stopped; no request can be served by this engine.
"""

# How a waiting request the scheduler ends before its deadline (its output can no longer be
# done by then) is told; the server names it in its 504.
CANNOT_FINISH = "it cannot finish before its deadline"


class EngineError(Exception):
    """Base of every error the engine raises deliberately."""


class InvalidRequestError(EngineError, ValueError):
    """The request is malformed or asks for something the engine cannot do."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestTooLargeError(InvalidRequestError):
    """Prompt plus max_tokens can never fit, however idle the engine is."""


class ModelLoadError(EngineError):
    """A model directory cannot be loaded; the message names what is missing or wrong."""


class EngineDeadError(EngineError):
    """The engine's step loop is no longer running."""
