"""Why the runtime refuses a request: the service answers BadRequest with 400 and Overloaded with 503."""


class Overloaded(Exception):
    """The queue is full: the caller should retry later."""


class BadRequest(ValueError):
    pass
