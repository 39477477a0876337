"""The one error hierarchy of kvroom.

    KvroomError
    ├── ProtocolError            a frame from the wire cannot be used
    │   ├── MalformedFrame       wrong frame count, bad header, undecodable body
    │   ├── FrameTooLarge        a frame above the size limit
    │   ├── VersionMismatch      a protocol version this build does not speak
    │   ├── UnknownMessageType   a type tag this build does not know
    │   └── RejectedMessage      well formed but not acceptable now
    │                            (unknown room, wrong rank, index out of range, duplicate)
    ├── IllegalTransition        a room state move the transition table forbids
    ├── AuxValidationError       aux bytes landed but do not belong to the room
    ├── PoolExhausted            no free KV page or aux slot
    ├── TransferError            the transfer engine failed a write
    ├── RegistrationError        the bootstrap refused or could not take a node
    ├── SecretError              a key or secret file is missing or unreadable
    ├── StoreUnavailable         the bootstrap's store cannot be reached (bootstrap.store)
    └── ClientError              the client's bootstrap refused or could not be reached (bootstrap.client)

Errors from zmq, the engine and httpx are translated at the boundary with
``raise ... from exc``.
"""


class KvroomError(Exception):
    """Base of every error kvroom raises on purpose."""


class ProtocolError(KvroomError):
    """A frame from the wire cannot be used; the receiver logs it and drops it."""

    kind = "protocol"


class MalformedFrame(ProtocolError):
    kind = "malformed"


class FrameTooLarge(ProtocolError):
    kind = "oversized"


class VersionMismatch(ProtocolError):
    kind = "version"


class UnknownMessageType(ProtocolError):
    kind = "unknown_type"


class RejectedMessage(ProtocolError):
    """A well-formed message that the receiver must not act on."""

    kind = "rejected"

    def __init__(self, message: str, *, room: int | None = None, kind: str | None = None):
        super().__init__(message)
        self.room = room
        if kind is not None:
            self.kind = kind


class IllegalTransition(KvroomError):
    def __init__(self, room: int, current: object, new: object):
        super().__init__(f"room {room}: illegal transition {current} -> {new}")
        self.room = room
        self.current = current
        self.new = new


class AuxValidationError(KvroomError):
    """The aux bytes in a slot do not match the room they claim to finish."""


class PoolExhausted(KvroomError):
    pass


class PagesStillLent(KvroomError):
    """Pages freed while a lease on them is open: a bug, never an input's fault."""


class TransferError(KvroomError):
    pass


class RegistrationError(KvroomError):
    def __init__(self, message: str, refused: bool = False):
        super().__init__(message)
        self.refused = refused  # the bootstrap said no, as opposed to not answering


class SecretError(KvroomError):
    """A key or secret file is missing or unreadable."""
