"""`python -m kernelforge ...`: the `kernelforge` command (kernelforge.cli), for environments where
the console script is not on PATH."""
import sys

from kernelforge.cli import main

if __name__ == "__main__":
    sys.exit(main())
