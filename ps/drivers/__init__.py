"""The drivers of the core: what feeds it inputs and carries out its commands.

Owns the ZeroMQ daemon (real clock, real socket) and its parts (the receive schedule, the
outputs, a sharded run's coordinator side), the deterministic simulator, exact replay of a
journal, the evaluator thread and the run's evaluations, and the assembly of a server from its
options (a new run or the run a state directory holds). May import: ps.core, ps.journal,
ps.net, ps.sharded, ps.observe.
"""
