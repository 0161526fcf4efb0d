"""Start an overlord-dask service whose loader workers are Slurm jobs (dask-jobqueue).

    python cluster/slurm.py pipelines/demo.yaml --jobs 4 --cores 8 --memory 32GB --queue cpu
    python cluster/slurm.py pipelines/demo.yaml --print-job-script      # inspect, no Slurm needed

The same as ``overlord slurm`` (``overlord_dask/service/slurm_job.py``, shipped in the package):
see its help for worker lifetimes and for resubmitting the service before its own walltime.
"""

from __future__ import annotations

import sys

from overlord_dask.service.slurm_job import main

if __name__ == "__main__":
    sys.exit(main())
