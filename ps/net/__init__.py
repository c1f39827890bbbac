"""The network edge: the server's end of the wire.

Owns the server-side transport (``ServerTransport``: the ROUTER socket, the connection table,
decoding with the protocol's limits, parts, same-host slots, the wire dtype, CurveZMQ identity),
used by both the daemon and the shards; the front and its supervisor; CurveZMQ keys; endpoints
given on the command line. May import: ps.core, ps.journal, protocol/.
"""
