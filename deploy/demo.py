"""The single-node demo as a script: the same as `tandem demo` (cluster/drivers/demo.py).

    python deploy/demo.py                    # disaggregated vs colocated through gRPC, side by side
    python deploy/demo.py --mode offline     # engine.LLM in this process
"""
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo's packages, installed or not
    from cluster.cli import main
    sys.exit(main(["demo", *sys.argv[1:]]))
