"""What one optimizer step needs on every backend: gradient accumulation and the optimizer/scheduler
wrappers (:mod:`.accumulation`), module buffers, mixed precision, and stop signals (preemption).
Below the session."""
