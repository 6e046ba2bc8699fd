"""``python -m bench.serve``: ``bench.serve.main`` under a watchdog.

The watchdog (``faulthandler.dump_traceback_later(..., exit=True)``) is
process-wide and kills the process when it fires, so only the command line
arms it; ``main()`` called from a test or a notebook arms nothing.
"""

import faulthandler

from bench.serve.cli import main, parse_args, watchdog_s

if __name__ == "__main__":
    faulthandler.dump_traceback_later(watchdog_s(parse_args()), exit=True)  # a hung run still ends, with stacks
    main()
