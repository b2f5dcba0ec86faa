"""The only package that imports deepspeed: distributed start-up, DeepSpeed configs, model loading, one model as one
engine (`role_engine`, shared by PPO, SFT and reward-model training), RLHFEngine."""
from .distributed import DistInfo, all_reduce, barrier, free_port, init_distributed
from .models import load_tokenizer
from .preflight import EnginePlan, RolePlan, plan_engine, plan_model
from .rlhf_engine import RLHFEngine
from .role_engine import backward_global, build_role_engine, export_engine, sequence_scores

__all__ = ["DistInfo", "EnginePlan", "RLHFEngine", "RolePlan", "plan_engine", "plan_model", "all_reduce", "backward_global", "barrier", "build_role_engine", "export_engine",
           "free_port", "init_distributed", "load_tokenizer", "sequence_scores"]
