"""The core: the sans-I/O heart of the server.

Owns the worker table, the job ledger, credit and liveness, the iterate store and dispatch
(``ServerCore`` composes them), and what a run trains (``spec``: ``TrainingSpec``, built from
flags or from what run.json recorded). Every method takes ``now``; nothing here touches a
socket, a clock, a thread or a file. May import: algorithms/, protocol/, problems/ (pure code).
Imported by every other package of ps/.
"""
