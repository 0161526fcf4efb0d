"""``python -m overlord_dask ...``: the ``overlord`` command, where its script is not on the PATH."""

if __name__ == "__main__":  # Dask's spawned worker processes import the main module again
    from .service.cli import main

    raise SystemExit(main())
