#!/usr/bin/env python3
"""The read-path benchmark; the same as `tensorfs bench`. See tensorfs/bench/.

.venv/bin/python scripts/bench.py [--quick] [--remote] [--gib 2] [--repeat 3] [--json FILE]
"""

import sys

from tensorfs.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
