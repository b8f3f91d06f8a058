"""The `ray job submit` entrypoint; the job itself is cluster/drivers/job.py.

    ray job submit --address http://HEAD:8265 --working-dir . -- python deploy/job.py --requests 8
    python deploy/job.py --requests 8          # stand-alone: a local Ray on 127.0.0.1, stopped at the end

`python deploy/job.py --help` lists the flags.
"""
import sys
from pathlib import Path

if __name__ == "__main__":
    # Run as a script from the repo (or the job's uploaded working dir): import the repo's packages.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from cluster.drivers.job import main
    sys.exit(main())
