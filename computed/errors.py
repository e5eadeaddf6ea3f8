"""Domain errors. Only the servicer maps them to status codes (service.STATUS_CODES);
DirectoryUnavailable stays inside computed (the engine recovers from it)."""


class RequestError(Exception):
    """The request itself is wrong; the message says what to fix (INVALID_ARGUMENT)."""


class CapacityError(Exception):
    """The pool could not hold this request even if it were empty (RESOURCE_EXHAUSTED)."""


class DirectoryUnavailable(Exception):
    """blockd cannot be reached or refused our pool; the engine re-registers and resyncs."""


class ShuttingDown(Exception):
    """computed is draining and admits nothing new; the client should retry elsewhere (UNAVAILABLE)."""


class ModelFailed(Exception):
    """The forward pass failed on the batch that held this request (INTERNAL); details are logged."""
