"""Domain errors a client can cause. Only the servicer maps them to gRPC status codes."""


class RequestError(Exception):
    """The request itself is wrong; the message says what to fix (INVALID_ARGUMENT)."""


class CapacityError(Exception):
    """The pool could not hold this request even if it were empty (RESOURCE_EXHAUSTED)."""


class DirectoryUnavailable(Exception):
    """blockd cannot be reached or refused our pool; the engine re-registers and resyncs."""
