"""ZeroMQ endpoints given on the command line, checked before anything runs.

One validator for every command that takes an endpoint (``serve --bind``, ``work --server``,
``status --server``, ``launch --server``), so a mistake is one line naming the fix rather than a
``ZMQError`` traceback, a misleading refusal, or a worker retrying an address that cannot exist.

Accepted forms:

- ``tcp://HOST:PORT``: HOST is a host name (letters, digits, ``-``, ``_``, dots), a dotted IPv4
  address, or an IPv6 address in brackets (``tcp://[::1]:5555``); PORT is 1-65535. Binding also
  takes HOST ``*`` (every interface) and PORT ``0`` or ``*`` (any free port).
- ``ipc://PATH``: a Unix socket path of at most ``IPC_PATH_MAX`` bytes (``ipc://*`` to bind
  a fresh one).
- ``inproc://NAME``: only for callers that pass ``allow_inproc=True``; an inproc endpoint reaches
  only sockets of the same process, so no command-line process can use one.

IPv6 needs ``zmq.IPV6`` on the socket: :func:`needs_ipv6` tells the daemon, the worker and
``status`` when to set it (only for IPv6 literals: setting it for IPv4 binds would change the
reported endpoint to ``[::ffff:...]``).
"""

from __future__ import annotations

import ipaddress
import re
import sys

import click

TRANSPORTS = ("tcp", "ipc", "inproc")
_LABEL = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")
_FORMS = "tcp://HOST:PORT or ipc://PATH"
# zmq.IPC_PATH_MAX_LEN: sockaddr_un.sun_path less its NUL (no zmq import here: only the shells import it)
IPC_PATH_MAX = 107 if sys.platform.startswith("linux") else 103


class EndpointError(ValueError):
    """An endpoint that cannot work; the message says what to give instead."""


def check_endpoint(text: str, *, bind: bool = False, allow_inproc: bool = False, remote: bool = False) -> str:
    """Validate ``text`` as an endpoint and return it (surrounding whitespace removed).

    Args:
        bind: the endpoint is bound (``serve --bind``): wildcard host ``*`` and port 0/``*`` allowed.
        allow_inproc: accept ``inproc://NAME`` (library callers in one process).
        remote: other machines connect to it (``launch --server``): wildcard addresses
            (0.0.0.0, ``[::]``) are refused, since a remote worker cannot reach them.

    Raises:
        EndpointError: with a one-line message naming the fix.
    """
    ep = text.strip()
    scheme, sep, rest = ep.partition("://")
    if not sep:
        parts = _split_host_port(ep)
        hint = f": did you mean tcp://{ep}?" if parts is not None and parts[0] and (parts[1] or "").isdigit() else ""
        raise EndpointError(f"expected {_FORMS}, got {text!r}{hint}")
    if scheme not in TRANSPORTS:
        raise EndpointError(f"unsupported transport {scheme + '://'!r} in {text!r}: use {_FORMS}")
    if scheme == "inproc":
        if not allow_inproc:
            raise EndpointError(f"{ep!r}: inproc:// reaches only sockets inside one process; use {_FORMS}")
        if not rest:
            raise EndpointError(f"{ep!r}: give a name, inproc://NAME")
        return ep
    if scheme == "ipc":
        return _check_ipc(ep, rest, bind=bind)
    return _check_tcp(ep, rest, bind=bind, remote=remote)


def _check_ipc(ep: str, path: str, *, bind: bool) -> str:
    if not path:
        raise EndpointError(f"{ep!r}: give a socket path, e.g. ipc:///tmp/latecomer.sock")
    if path == "*" and not bind:
        raise EndpointError(f"{ep!r}: ipc://* only binds; connect to the path the server printed")
    if len(path.encode()) > IPC_PATH_MAX:
        raise EndpointError(f"{ep!r}: the socket path is longer than {IPC_PATH_MAX} bytes; "
                            "give a shorter one (e.g. under /tmp)")
    return ep


def _split_host_port(authority: str) -> tuple[str, str | None] | None:
    """(host, port or None) of ``HOST:PORT``/``[V6]:PORT``; None when brackets do not close."""
    if authority.startswith("["):
        end = authority.find("]")
        if end < 0:
            return None
        host, tail = authority[:end + 1], authority[end + 1:]
        if not tail:
            return host, None
        if not tail.startswith(":"):
            return None
        return host, tail[1:]
    host, sep, port = authority.rpartition(":")
    if not sep:
        return authority, None
    return host, port


def _check_tcp(ep: str, authority: str, *, bind: bool, remote: bool) -> str:
    if authority.count(":") > 1 and not authority.startswith("["):  # a bare IPv6 address
        host, _, port = authority.rpartition(":")
        if not (_is_ipv6(host) and port.isascii() and port.isdigit()):
            if not _is_ipv6(authority):
                raise EndpointError(f"{ep!r}: expected tcp://HOST:PORT (IPv6 in brackets: tcp://[::1]:5555)")
            host, port = authority, "PORT"
        raise EndpointError(f"{ep!r}: put an IPv6 address in brackets, e.g. tcp://[{host}]:{port}")
    parts = _split_host_port(authority)
    if parts is None:
        raise EndpointError(f"{ep!r}: expected tcp://HOST:PORT (IPv6 in brackets: tcp://[::1]:5555)")
    host, port = parts
    if port is None:
        h = host or "HOST"
        raise EndpointError(f"{ep!r} has no port: give tcp://{h}:PORT, e.g. tcp://{h}:5555"
                            + (" (port 0: any free port)" if bind else " (the port the server listens on)"))
    _check_host(ep, host, bind=bind, remote=remote)
    _check_port(ep, port, bind=bind)
    return ep


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def _check_host(ep: str, host: str, *, bind: bool, remote: bool) -> None:
    if not host:
        raise EndpointError(f"{ep!r} has no host: give tcp://HOST:PORT"
                            + (" (tcp://*:PORT binds every interface)" if bind else ""))
    if host == "*":
        if not bind:
            raise EndpointError(f"{ep!r}: * only binds; connect to the server's host name or address")
        return
    if host.startswith("["):
        try:
            addr = ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise EndpointError(f"{ep!r}: {host[1:-1]!r} is not an IPv6 address") from None
        if remote and addr.is_unspecified:
            raise EndpointError(f"{ep!r}: [::] is where a server listens, not an address workers can reach: "
                                "give the server host's name or address")
        return
    if re.fullmatch(r"[0-9.]+", host):
        try:
            addr4 = ipaddress.IPv4Address(host)
        except ValueError:
            raise EndpointError(f"{ep!r}: {host!r} is not an IPv4 address (four numbers 0-255, e.g. "
                                "127.0.0.1)") from None
        if remote and addr4.is_unspecified:
            raise EndpointError(f"{ep!r}: 0.0.0.0 is where a server listens, not an address workers can reach: "
                                "give the server host's name or address")
        return
    name = host[:-1] if host.endswith(".") else host
    if len(name) > 253 or not all(_LABEL.match(label) for label in name.split(".")):
        raise EndpointError(f"{ep!r}: {host!r} is not a host name (letters, digits, '-', '_' and dots) "
                            "or an IP address")


def _check_port(ep: str, port: str, *, bind: bool) -> None:
    if bind and port == "*":
        return
    if not port.isascii() or not port.isdigit():
        raise EndpointError(f"{ep!r}: the port must be a number 1-65535"
                            + (" (0 or *: any free port)" if bind else "") + f", got {port!r}")
    n = int(port)
    if n == 0 and bind:
        return
    if not 1 <= n <= 65535:
        raise EndpointError(f"{ep!r}: port {n} is out of range: give 1-65535"
                            + (" (0: any free port)" if bind else ""))


def needs_ipv6(endpoint: str) -> bool:
    """True for a ``tcp://[V6]:PORT`` endpoint: its socket needs ``zmq.IPV6`` set."""
    return endpoint.startswith("tcp://[")


# --------------------------------------------------------------------------- click callbacks

def _callback(**kw):
    def callback(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return check_endpoint(value, **kw)
        except EndpointError as e:
            raise click.BadParameter(str(e), ctx=ctx, param=param) from None
    return callback


bind_endpoint = _callback(bind=True)
"""click callback for an endpoint the command binds (``serve --bind``)."""

server_endpoint = _callback()
"""click callback for the server endpoint a process connects to (``work``/``status --server``)."""

remote_server_endpoint = _callback(remote=True)
"""click callback for the endpoint that workers on other hosts connect to (``launch --server``)."""
