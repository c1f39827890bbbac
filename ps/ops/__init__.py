"""Operator tools: what a person runs beside a server (``status``, ``report``, ``launch``,
``chaos``, ``export``, the dashboard, ``conformance``: a fake server that checks a worker) and
the child processes they start and reap. They talk to a
server over its own protocol or read what it wrote; none of them is part of the server's message
path (docs/ARCHITECTURE.md). May import: ps.core, ps.journal, ps.net, ps.drivers, ps.observe.
"""
