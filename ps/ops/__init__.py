"""Operator tools: what a person runs beside a server (``status``, ``report``, ``launch``,
``chaos``, ``export``). They talk to a server over its own protocol or read what it wrote; none
of them is part of the server's message path (docs/ARCHITECTURE.md)."""
