"""``python -m rlharvest``: same as the ``rlharvest`` console script."""

import atexit
import os
import sys

from .cli import main

if __name__ == "__main__":
    status = main()
    if sys.argv[1:2] == ["node"]:
        # A node (what join_command() runs) ends as a worker process does, as multiprocessing ends its
        # children: the exit handlers run and the output is flushed, but not the interpreter's teardown
        # (seconds of CPU with torch loaded, on a busy host), which the collector's shutdown() would
        # otherwise wait for (it returns once its nodes have exited: docs/elastic.md).
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
