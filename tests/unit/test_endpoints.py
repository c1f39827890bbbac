"""ps/net/endpoints.py: one validator for every endpoint the commands take (what is accepted, what is
refused and the fix each refusal names)."""

from __future__ import annotations

import pytest

from ps.net.endpoints import EndpointError, check_endpoint, needs_ipv6


@pytest.mark.parametrize("ep,kw", [
    ("tcp://127.0.0.1:5555", {}),
    ("tcp://localhost:1", {}),
    ("tcp://gpu7.cluster.example.org:65535", {}),
    ("tcp://latecomer_server:5555", {}),  # compose service names may hold '_'
    ("tcp://server.:5555", {}),  # a fully qualified name with its root dot
    ("tcp://[::1]:5555", {}),
    ("tcp://[fe80::1%eth0]:5555", {}),
    ("tcp://0.0.0.0:5555", {}),  # connecting to 0.0.0.0 reaches this host on Linux
    ("tcp://*:5555", {"bind": True}),
    ("tcp://127.0.0.1:0", {"bind": True}),
    ("tcp://127.0.0.1:*", {"bind": True}),
    ("tcp://[::]:0", {"bind": True}),
    ("tcp://eth0:5555", {"bind": True}),  # an interface name
    ("ipc:///tmp/latecomer.sock", {}),
    ("ipc://@abstract", {}),
    ("ipc://*", {"bind": True}),
    ("inproc://daemon", {"allow_inproc": True}),
])
def test_endpoints_accepted(ep, kw):
    assert check_endpoint(ep, **kw) == ep


def test_endpoints_surrounding_whitespace_is_dropped():
    assert check_endpoint("  tcp://h:1\n") == "tcp://h:1"  # e.g. an environment variable read from a file


@pytest.mark.parametrize("ep,kw,fix", [
    ("tcp://127.0.0.1", {}, "give tcp://127.0.0.1:PORT"),
    ("tcp://127.0.0.1", {"bind": True}, "port 0: any free port"),
    ("tcp://[::1]", {}, "give tcp://[::1]:PORT"),
    ("garbage", {}, "expected tcp://HOST:PORT or ipc://PATH"),
    ("127.0.0.1:5694", {"bind": True}, "did you mean tcp://127.0.0.1:5694?"),
    ("localhost:5555", {}, "did you mean tcp://localhost:5555?"),
    ("tcp://127.0.0.1:99999", {}, "port 99999 is out of range: give 1-65535"),
    ("tcp://127.0.0.1:99999", {"bind": True}, "(0: any free port)"),
    ("tcp://127.0.0.1:0", {}, "port 0 is out of range: give 1-65535"),
    ("tcp://127.0.0.1:*", {}, "the port must be a number 1-65535"),
    ("tcp://host:5555/path", {}, "the port must be a number 1-65535"),
    ("tcp://host:+1", {}, "the port must be a number"),
    ("tcp://host:\u0663", {}, "the port must be a number"),  # a non-ASCII digit
    ("tcp://*:5555", {}, "* only binds"),
    ("tcp://:5555", {"bind": True}, "tcp://*:PORT binds every interface"),
    ("tcp://::1:5555", {}, "tcp://[::1]:5555"),
    ("tcp://::1", {}, "tcp://[::1]:PORT"),
    ("tcp://[::1", {}, "IPv6 in brackets"),
    ("tcp://[::1]x", {}, "IPv6 in brackets"),
    ("tcp://[nope]:1", {}, "is not an IPv6 address"),
    ("tcp://999.1.1.1:5555", {}, "is not an IPv4 address"),
    ("tcp://127.0.0:5555", {}, "is not an IPv4 address"),
    ("tcp://-bad:5555", {}, "is not a host name"),
    ("tcp://a b:5555", {}, "is not a host name"),
    ("tcp://" + "a" * 64 + ":5555", {}, "is not a host name"),
    ("tcp://0.0.0.0:5555", {"remote": True}, "give the server host's name or address"),
    ("tcp://[::]:5555", {"remote": True}, "give the server host's name or address"),
    ("udp://host:5555", {}, "unsupported transport 'udp://'"),
    ("TCP://host:5555", {}, "unsupported transport"),
    ("ipc://", {}, "give a socket path"),
    ("ipc://*", {}, "ipc://* only binds"),
    ("ipc:///tmp/" + "s" * 120, {}, "give a shorter one"),
    ("inproc://daemon", {}, "inproc:// reaches only sockets inside one process"),
    ("inproc://", {"allow_inproc": True}, "give a name"),
])
def test_endpoints_refused_with_the_fix(ep, kw, fix):
    with pytest.raises(EndpointError) as e:
        check_endpoint(ep, **kw)
    msg = str(e.value)
    assert fix in msg and "\n" not in msg, msg


def test_endpoints_ipv6_literals_need_the_socket_option():
    assert needs_ipv6("tcp://[::1]:5555") and needs_ipv6("tcp://[::]:0")
    assert not needs_ipv6("tcp://127.0.0.1:5555") and not needs_ipv6("ipc:///tmp/x")
