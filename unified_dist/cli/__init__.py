"""The ``unified-dist`` command (also ``python -m unified_dist``).

    unified-dist env      versions, backends, Horovod's build, devices, what would run here and why
    unified-dist launch   one command line for torchrun, accelerate launch and horovodrun
    unified-dist plan     one simulated rank of a large world: what it holds and sends
    unified-dist test     a self-test of every collective and a training step under each real launcher
    unified-dist parity   one training script under several launchers, metrics compared step by step

One module per subcommand; ``main`` only wires argparse. The checks the commands run (and their
workers) are :mod:`unified_dist.checks`. Backend libraries are imported inside the functions that
probe or run them, so the command works without them.
"""
