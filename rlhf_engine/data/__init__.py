"""Prompt data: loading and checking, deterministic sharded sampling, collation."""
from .prompts import PromptDataset, PromptSampler, collate_prompts, load_prompt_dataset

__all__ = ["PromptDataset", "PromptSampler", "collate_prompts", "load_prompt_dataset"]
