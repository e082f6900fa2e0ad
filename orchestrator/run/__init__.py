"""What a user runs: the `tide` CLI (cli.py) and its Python API (api.py: run and resume in the calling process,
optionally on worker pools kept between runs), the supervisor that restarts a faulted run (supervisor.py), how a
failure is reported and its exit code (failures.py), `tide inspect` and its plots, and `tide export`."""
