"""``python -m bench.transfer``."""

from bench.transfer.cli import main

if __name__ == "__main__":
    main()
