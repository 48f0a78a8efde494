"""What a checkpoint is made of: portable files that never run code on load (:mod:`.files`), sharded
checkpoints (:mod:`.sharded`), random generator states (:mod:`.rng`). Below the session; the public
functions that write and read them are :mod:`unified_dist.saving` and :mod:`unified_dist.elastic`."""
