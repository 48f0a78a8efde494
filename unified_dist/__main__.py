"""``python -m unified_dist ...`` is the ``unified-dist`` command."""
from .cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
