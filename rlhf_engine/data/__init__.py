"""Prompt data: loading and checking (several formats, blends, templates, policies), deterministic sharded sampling,
collation."""
from .prompts import (DataStats, PromptData, PromptDataset, PromptSampler, SourceStats, blend_counts, blend_indices,
                      collate_prompts, load_prompt_data, load_prompt_dataset, split_indices)
from .sources import read_source

__all__ = ["DataStats", "PromptData", "PromptDataset", "PromptSampler", "SourceStats", "blend_counts", "blend_indices",
           "collate_prompts", "load_prompt_data", "load_prompt_dataset", "read_source", "split_indices"]
