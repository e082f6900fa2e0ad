"""Programs the sandbox writes into containers (judges, drivers, checkers): plain files read by the runtime, run
by the container's python3, never imported by the service except `checkers` (shared with the judge driver)."""
