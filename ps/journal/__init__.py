"""The journal: what a run writes to its state directory and reads back.

Its modules, lowest first (each imports only those before it):

- ``statedir``: :class:`StateError` and ``fsync_dir``, which every file of a state directory shares;
- ``statefiles``: the one checked reader of its small files (JSON of bounded size and depth,
  ``final_x.npy`` with its header checked first) and the depth bound of checkpoint trees;
- ``records``: a journal record's framing, :class:`Record`, and what each op's record must hold;
- ``checkpoints``: checkpoint files (``ckpt-<LSN>.bin``), written atomically, verified when read;
- ``segments``: the journal's files read back (``read_journal``, torn tails, ``JournalDamaged``);
- ``wal``: :class:`Journal`, the writer (segments, rotation, pruning, the fsync policy);
- ``repair``: ``serve --repair`` (keep the valid prefix, move the rest aside);
- ``runfile``: ``run.json``; ``lock``: the live server's lock; ``events``: the event log;
- ``replies``: a journaled reply turned back into the one the core saw (wire dtype, seed);
- ``inputs``: :class:`CoreInputs`, every core input, journaled first, then fed to the core
  (replay feeds the same methods);
- ``persistence``: :class:`Persistence`, the daemon's side (journals each input, checkpoints,
  bounds the journal, pauses on a full disk);
- ``recovery``: a checkpoint plus the journal after it, fed back through ``CoreInputs``.

May import: ps.core, algorithms/, protocol/, problems/, worker.compute (recomputed replies).
"""
