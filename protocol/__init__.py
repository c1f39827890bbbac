"""Wire format of latecomer: message dataclasses and a pure encode/decode codec (no sockets)."""

from protocol.codec import decode, encode
from protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from protocol.messages import (
    PROTOCOL_VERSION,
    Bye,
    Cancel,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    Job,
    JobKind,
    Message,
    Ready,
    Reply,
    Welcome,
)

__all__ = [
    "PROTOCOL_VERSION", "Bye", "Cancel", "Error", "ErrorCode", "Heartbeat", "Hello", "Job", "JobKind",
    "LocalProtocolError", "Message", "ProtocolError", "Ready", "RemoteProtocolError", "Reply", "Welcome",
    "decode", "encode",
]
