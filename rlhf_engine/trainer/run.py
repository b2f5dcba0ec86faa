"""The PPO recipe: validate -> distributed -> data -> engines -> train. `launch/train_ppo.py` only parses and calls this.

Cheap checks (config, data file, prompt lengths, model configs) all run before any weights are loaded.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from typing import Optional

import torch

from ..config import TrainConfig
from ..data.prompts import PromptSampler, load_prompt_data
from ..engine import RLHFEngine, init_distributed, load_tokenizer
from .ppo_trainer import PPOTrainer, updates_per_iteration

log = logging.getLogger("rlhf_engine")


def setup_logging(is_main: bool) -> None:
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    import transformers

    transformers.utils.logging.disable_progress_bar()  # per-role "Loading weights" bars on every rank are noise


def build_trainer(cfg: TrainConfig, argv: Optional[list] = None) -> PPOTrainer:
    cfg.validate()
    dist = init_distributed()
    setup_logging(dist.is_main)
    from ..engine.preflight import plan_roles

    plan_roles(cfg)  # model-side checks before the data is tokenized
    tokenizer = load_tokenizer(cfg.actor.tokenizer_name_or_path or cfg.actor.model_name_or_path)
    dataset = load_prompt_data(cfg.data, tokenizer, cfg.generation.max_prompt_seq_len, seed=cfg.seed,
                               verbose=dist.is_main).train
    # too few prompts for one global batch is a batch-arithmetic error: report it before any weight is loaded
    PromptSampler(len(dataset), cfg.batch.per_device_generation_batch_size, dist.rank, dist.world_size, cfg.seed)
    if dist.is_main:
        from ..cli import flat_dict

        os.makedirs(cfg.output_dir, exist_ok=True)
        with open(os.path.join(cfg.output_dir, "config.json"), "w") as f:
            json.dump(flat_dict(cfg), f, indent=2, sort_keys=True)
        if argv is not None:
            with open(os.path.join(cfg.output_dir, "command.txt"), "w") as f:
                f.write(" ".join(argv) + "\n")
    # Anything drawn while the engines are built (a new critic head with critic_init_from=actor) depends on the seed
    # only, identically on every rank; the trainer then reseeds with seed + rank for sampling.
    torch.manual_seed(cfg.seed)
    engine = RLHFEngine(cfg, dist, num_training_steps=cfg.max_steps * updates_per_iteration(cfg),
                        output_dir=cfg.output_dir)
    return PPOTrainer(cfg, engine, dataset)


def run_ppo(cfg: TrainConfig, argv: Optional[list] = None) -> PPOTrainer:
    trainer = build_trainer(cfg, argv)
    trainer.train()
    return trainer


def shutdown_distributed(ok: bool) -> None:
    """End of a launch script (`if __name__ == "__main__"`, never in-process): tear the process group down on every
    rank together. Exiting with it alive let one gloo rank abort after a complete run while its peer was already gone
    ('terminate called without an active exception', exit code -6; 2 of 8 two-rank launches on a loaded machine)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if ok:
            torch.distributed.barrier()  # every rank has finished: nobody closes a connection a peer still uses
        torch.distributed.destroy_process_group()
