"""Prompt data: loading and checking (several formats, blends, templates, policies), deterministic sharded sampling,
collation; SFT and preference data on the same pipeline (`supervised`)."""
from .columns import ColumnRequest
from .prompts import (DataStats, PromptData, PromptDataset, SourceStats, blend_counts, blend_indices, collate_prompts,
                      load_prompt_data, load_prompt_dataset, split_indices)
from .sampler import DataCursor, PromptSampler
from .sources import read_source
from .supervised import (PairBatch, SFTBatch, collate_pairs, collate_sft, eval_shards, load_preference_data,
                         load_sft_data)

__all__ = ["ColumnRequest", "DataCursor", "DataStats", "PairBatch", "PromptData", "PromptDataset", "PromptSampler", "SFTBatch", "SourceStats",
           "blend_counts", "blend_indices", "collate_pairs", "collate_prompts", "collate_sft", "eval_shards",
           "load_preference_data", "load_prompt_data", "load_prompt_dataset", "load_sft_data", "read_source",
           "split_indices"]
