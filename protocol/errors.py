"""Protocol errors, split as in h11: who is at fault decides what happens next."""


class ProtocolError(Exception):
    """Base class of every protocol error."""


class LocalProtocolError(ProtocolError):
    """We tried to build or send a bad message: a bug on our side. Let it crash in tests."""


class RemoteProtocolError(ProtocolError):
    """A peer sent bytes that are not a valid message. Log it, answer ``Error``, keep serving.

    Decoding untrusted bytes raises this type and never anything else.
    """


class UnsupportedVersion(RemoteProtocolError):
    """The peer speaks a protocol version we do not (answer ``Error(UNSUPPORTED_VERSION)``)."""
