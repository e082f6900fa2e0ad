"""What a pull through the Mooncake transport raises: `TransferError`, a subclass saying what went wrong, naming
the shard and the peer."""
from __future__ import annotations


class TransferError(RuntimeError):
    """A file could not be pulled; `shard` and `peer` name what failed."""

    def __init__(self, message: str, shard: str | None = None, peer: str | None = None) -> None:
        super().__init__(message)
        self.shard = shard
        self.peer = peer


class PeerUnavailableError(TransferError):
    """The peer cannot be reached, its file table cannot be read, or a read from it failed."""


class ShardNotServedError(TransferError):
    """The peer does not serve the file asked for."""


class ChecksumMismatchError(TransferError):
    """The file pulled, or its size on the peer, is not the one its record names."""


class TransferTimeoutError(TransferError):
    """A read, or a pull attempt's reads together, ran past the deadline."""



class NodeAgentLostError(TransferError):
    """A node's agent (the process serving or pulling its shared memory) died or does not answer; `peer` names the
    node."""
