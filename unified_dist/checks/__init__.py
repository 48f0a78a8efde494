"""The checks the ``unified-dist`` commands run, one module per area; ``cli/`` holds only the commands
that parse the options, start these and print.

- ``unified-dist test``: :mod:`.contract` (the facade's contract as checks, the list the tests' contract
  suite starts with), :mod:`.selftest_worker` (runs it in every rank under a real launcher) and
  :mod:`.selftest` (launches it per backend, kills a hung launch, merges the ranks' results into rows);
- ``unified-dist test --gpu`` (``make gpu-check``): :mod:`.gpu_checks` (one function per CUDA path, and
  the worker that runs them) and :mod:`.gpu` (runs each in a worker within its budget, the results
  record);
- ``unified-dist parity``: :mod:`.parity` (runs' metrics compared step by step);
- ``unified-dist plan``: :mod:`.plan_worker` (one simulated rank of a large world, on fake tensors);
- :mod:`.processes`: the clean environment and the process-tree kill of the launches above.

Workers run by path (``selftest_worker.py``) or by module (``python -m unified_dist.checks.gpu_checks``,
``python -m unified_dist.checks.plan_worker``). Nothing here imports ``unified_dist.cli``; importing
this package imports no torch.
"""
