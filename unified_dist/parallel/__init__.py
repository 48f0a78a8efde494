"""How a model is split over ranks: FSDP2/HSDP sharding, tensor parallelism, the device mesh and its
layout, SyncBatchNorm, and ``torch.compile`` of the split model. Below the session: nothing here
imports the session or the public API; the backends call in."""
