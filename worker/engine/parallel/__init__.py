"""Tensor parallelism: one worker owning N ranks (``--tensor-parallel-size N``).

Rank 0 is the engine (scheduler, sampler, the broker link); ranks 1..N-1 are
follower processes it starts, running the same sharded model in lockstep on the
step layouts rank 0 broadcasts (``follower``).  ``state`` holds this process's
rank and the collectives, ``sharding`` which slice of each weight a rank owns.
"""
