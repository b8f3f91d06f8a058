"""`python -m cluster.selftest [options]`: the same as `tandem selftest` (no Ray, no other subcommand)."""
from __future__ import annotations

import argparse
import logging
import sys

from cluster.selftest import command

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m cluster.selftest", description=command.DESCRIPTION)
    command.add_arguments(parser)
    sys.exit(command.run(parser.parse_args()))
