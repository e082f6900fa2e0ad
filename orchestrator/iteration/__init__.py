"""One RL run's session (session.py: the components started and the phases between them: publish, sync, the warm
start) and its iterations (loop.py), each drawing its batch through the schedule (schedule.py), scoring, training
and checking it (batches.py, checks.py), evaluating and checkpointing; and the JAX engine's loop (jax_loop.py)."""
