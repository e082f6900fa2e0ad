"""What a user runs: the `tide` CLI (cli.py), the supervisor that restarts a faulted run (supervisor.py), how a
failure is reported and its exit code (failures.py), `tide inspect` and its plots, and `tide export`."""
