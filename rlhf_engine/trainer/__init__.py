"""PPO loop, experience making and the run recipe (built on engine, rollout, ppo_math and data)."""
from .ppo_trainer import PPOTrainer, updates_per_iteration
from .run import build_trainer, run_ppo

__all__ = ["PPOTrainer", "build_trainer", "run_ppo", "updates_per_iteration"]
