"""The only package that imports deepspeed: distributed start-up, DeepSpeed configs, model loading, RLHFEngine."""
from .distributed import DistInfo, all_reduce, barrier, free_port, init_distributed
from .rlhf_engine import RLHFEngine, load_tokenizer

__all__ = ["DistInfo", "RLHFEngine", "all_reduce", "barrier", "free_port", "init_distributed", "load_tokenizer"]
