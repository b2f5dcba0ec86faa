"""PPO loop, experience making and the run recipe; the SFT and reward-model trainers of steps 1 and 2 on the same
pieces (built on engine, rollout, ppo_math and data)."""
from .ppo_trainer import PPOTrainer, updates_per_iteration
from .reward_model import RewardModelTrainer, run_reward_model
from .run import build_trainer, run_ppo
from .sft import SFTTrainer, run_sft
from .supervised import SupervisedTrainer, build_supervised, run_supervised

__all__ = ["PPOTrainer", "RewardModelTrainer", "SFTTrainer", "SupervisedTrainer", "build_supervised", "build_trainer",
           "run_ppo", "run_reward_model", "run_sft", "run_supervised", "updates_per_iteration"]
