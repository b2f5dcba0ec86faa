"""Processes that serve a trainer from outside its DeepSpeed world: rollout workers (rollout_worker.py)."""
