"""The ``fv`` command line (Typer). The root app lives in :mod:`fv_kernel.cli.app`."""
