"""The ``latecomer`` command line: one module per command group; each command parses, calls one
function of another package, and prints. May import every package of ps/; nothing imports it
except ``python -m ps`` and the console script.
"""
