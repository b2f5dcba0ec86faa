"""PPO loop, experience making and the run recipe; the SFT and reward-model trainers of steps 1 and 2 on the same
pieces (built on engine, rollout, ppo_math and data)."""
from .plan import RunPlan, SupervisedPlan, plan_ppo, plan_supervised, updates_per_iteration
from .ppo_trainer import PPOTrainer
from .reward_model import RewardModelTrainer, run_reward_model
from .run import build_trainer, run_ppo
from .sft import SFTTrainer, run_sft
from .supervised import SupervisedTrainer, build_supervised, run_supervised

__all__ = ["PPOTrainer", "RewardModelTrainer", "RunPlan", "SFTTrainer", "SupervisedPlan", "SupervisedTrainer",
           "build_supervised", "build_trainer", "plan_ppo", "plan_supervised", "run_ppo", "run_reward_model", "run_sft",
           "run_supervised", "updates_per_iteration"]
