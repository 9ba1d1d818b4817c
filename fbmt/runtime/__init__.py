"""Runtime: collectives as graph nodes, shards, partition into forward/backward, the compiled module."""
