"""``python -m unified_dist.parity ARGS`` is the older spelling of ``unified-dist parity ARGS``."""
import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main(["parity", *sys.argv[1:]]))
