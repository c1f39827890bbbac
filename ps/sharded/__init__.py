"""The sharded server: a coordinator and S shard processes, each holding a block of the vector.

Owns the coordinator's hub (``ShardHub``, added to the ordinary daemon, with its parts: the
shard table ``hub_table``, the records shipped ``hub_records``, the iterates gathered
``hub_gathers``), the shard process (``Shard``, whose data path is the network edge's
``ServerTransport``), and the small coordinator-shard control channel (``control``). May
import: ps.core, ps.journal, ps.net.
"""
