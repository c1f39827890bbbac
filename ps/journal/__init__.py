"""The journal: what a run writes to its state directory and reads back.

Owns the write-ahead journal's segments, checkpoints, recovery and repair, the run file, the
event log, and ``CoreInputs`` (every core input, journaled first, then fed to the core; replay
feeds the same methods). May import: ps.core, algorithms/, protocol/, problems/.
"""
