"""``python -m benchmarks [--quick | --smoke]``: see :mod:`benchmarks.run`."""

from __future__ import annotations

if __name__ == "__main__":
    from benchmarks.run import main

    raise SystemExit(main())
