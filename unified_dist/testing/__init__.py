"""What this repository's tests and benchmarks share (as ``accelerate.test_utils`` is Accelerate's).

- :mod:`unified_dist.testing.launchers`: run a script under a real launcher with a free port and a
  timeout that kills the launcher's whole process tree; a clean child environment.
- :mod:`unified_dist.testing.multinode`: two hosts made of network namespaces, and the launch
  lines users type on each node of a two-node job.
- :mod:`unified_dist.testing.replica_runs`: what the replica-group launch tests and their workers share
  (the workers' records, the launch command, a launch in the background, a lighthouse started by hand).
- :mod:`unified_dist.testing.tiny_bert`: the 2-layer BERT the tests give examples/bert_sentiment as ``--model``.
- :class:`unified_dist.testing.launchers.LaunchWatch`: whether code launched processes (the tests'
  ``distributed`` marker must say so).

The library never imports this package and importing it imports no torch (tests/unit/test_markers.py
checks both). It expects to lie in a checkout: ``launchers.ROOT`` is the repository root.
"""
