"""`python -m colo_data.cli` runs the `colo-data` command (used to start local sidecars)."""

from colo_data.cli import main

main()
