"""The only package that imports deepspeed: distributed start-up, DeepSpeed configs, model loading, one model as one
engine (`role_engine`, shared by PPO, SFT and reward-model training), RLHFEngine."""
from .distributed import DistInfo, all_reduce, barrier, free_port, init_distributed
from .rlhf_engine import RLHFEngine, load_tokenizer
from .role_engine import backward_global, build_role_engine, export_engine, sequence_scores

__all__ = ["DistInfo", "RLHFEngine", "all_reduce", "backward_global", "barrier", "build_role_engine", "export_engine",
           "free_port", "init_distributed", "load_tokenizer", "sequence_scores"]
