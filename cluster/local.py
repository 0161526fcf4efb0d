"""Start an overlord-dask service on an embedded LocalCluster and keep it running.

    python cluster/local.py pipelines/demo.yaml --workers 2

Prints the scheduler address that trainers pass to ``OverlordDataset(address, rank=r)``.
This is what ``overlord serve`` does; it is here as the reference deployment.
"""

from overlord_dask.service.cli import main

if __name__ == "__main__":
    import sys

    main(["serve", *sys.argv[1:]])
