"""The run directory: every path under `output_dir`, and its overwrite / resume policy. The one owner of both.

| path | what |
|---|---|
| `config.json`, `command.txt` | the resolved config and the command line (redacted), `write_run_files` |
| `ds_config_<role>.json` | each engine's resolved DeepSpeed config, `write_ds_configs` |
| `metrics.jsonl` | one record per iteration (or optimizer step) |
| `samples.jsonl`, `eval_samples.jsonl` | prompt / response / score rows of training and of evaluation |
| `metrics.png` | the plot written when the run ends |
| `checkpoints/` | checkpoints (outputs/checkpoint.py) |
| `tensorboard/`, `wandb/` | the sinks' own folders (`wandb/run_id`: the wandb run a resume continues) |
| `model/`, `final/` | the exported Hugging Face folders (SFT / reward model; PPO's export_final) |

Another run is in the folder when `metrics.jsonl` or `checkpoints/` exists. `overwrite_output_dir` moves every run
file aside (`RUN_FILES`, the ds_config files too) as `<name>.<YYYYmmdd-HHMMSS>.bak`; wandb/ stays (every wandb run has
its own folder). A resume trims the record files (`RECORD_FILES`) to the iterations before the checkpoint.
"""
from __future__ import annotations

import json
import logging
import os
import shlex
import time
from typing import Mapping, Sequence

from ..errors import ConfigError, Problem

log = logging.getLogger("rlhf_engine.outputs")

METRICS, SAMPLES, EVAL_SAMPLES = "metrics.jsonl", "samples.jsonl", "eval_samples.jsonl"
CONFIG, COMMAND, PLOT = "config.json", "command.txt", "metrics.png"
CHECKPOINTS, TENSORBOARD, WANDB = "checkpoints", "tensorboard", "wandb"
MODEL, FINAL = "model", "final"
WANDB_ID = "run_id"
RECORD_FILES = (METRICS, SAMPLES, EVAL_SAMPLES)  # one record per line, keyed by "iteration"
RUN_MARKERS = (METRICS, CHECKPOINTS)  # what holds "another run"
RUN_FILES = (*RECORD_FILES, CONFIG, COMMAND, PLOT, CHECKPOINTS, TENSORBOARD, MODEL, FINAL)  # overwrite moves these
DS_CONFIG_PREFIX = "ds_config_"


class RunDir:
    """The paths of one run directory (nothing is created until a writer needs it)."""

    def __init__(self, root: str):
        self.root = root

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    metrics = property(lambda self: self.path(METRICS))
    samples = property(lambda self: self.path(SAMPLES))
    eval_samples = property(lambda self: self.path(EVAL_SAMPLES))
    config = property(lambda self: self.path(CONFIG))
    command = property(lambda self: self.path(COMMAND))
    plot = property(lambda self: self.path(PLOT))
    checkpoints = property(lambda self: self.path(CHECKPOINTS))
    tensorboard = property(lambda self: self.path(TENSORBOARD))
    wandb_id = property(lambda self: os.path.join(self.root, WANDB, WANDB_ID))
    model = property(lambda self: self.path(MODEL))
    final = property(lambda self: self.path(FINAL))

    def ds_config(self, role: str) -> str:
        return self.path(f"{DS_CONFIG_PREFIX}{role}.json")

    # ---- policy ------------------------------------------------------------------------------------------------
    def holds_run(self) -> bool:
        """True when the folder holds another run: a metrics.jsonl or a checkpoints/ folder."""
        return any(os.path.exists(self.path(m)) for m in RUN_MARKERS)

    def check(self, resume: bool, overwrite: bool) -> None:
        """The read-only half of `prepare` (every rank may call it and raise the same error): a `ConfigError` when
        the folder is a file, or holds another run and neither `resume` nor `overwrite` is set."""
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise ConfigError([Problem("output_dir", self.root, "is a file; give a folder for the run")],
                              "invalid output directory")
        if self.holds_run() and not resume and not overwrite:
            found = [m for m in RUN_MARKERS if os.path.exists(self.path(m))]
            raise ConfigError([Problem("output_dir", self.root,
                                       f"holds another run ({', '.join(found)} exist); pass --resume auto to "
                                       f"continue it, --overwrite_output_dir to start a new run there (the old files "
                                       f"are kept, renamed *.<timestamp>.bak), or choose another --output_dir")],
                              "output directory in use")

    def prepare(self, resume: bool, overwrite: bool, is_main: bool = True) -> list[str]:
        """Apply the policy (module docstring): `check`, then on the main rank create the folder and, with
        `overwrite` (and no resume), move the previous run's files aside. Returns the backup paths. Other ranks must
        wait for the main rank (a barrier) before writing."""
        self.check(resume, overwrite)
        moved: list[str] = []
        if not is_main:
            return moved
        os.makedirs(self.root, exist_ok=True)
        if overwrite and not resume:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            names = list(RUN_FILES) + sorted(n for n in os.listdir(self.root)
                                             if n.startswith(DS_CONFIG_PREFIX) and n.endswith(".json"))
            for name in names:
                src = self.path(name)
                if not os.path.exists(src):
                    continue
                dst, k = f"{src}.{stamp}.bak", 1
                while os.path.exists(dst):  # two overwrites in one second: never replace an older backup
                    dst, k = f"{src}.{stamp}-{k}.bak", k + 1
                os.rename(src, dst)
                moved.append(dst)
            if moved:
                log.warning("overwrite_output_dir: kept the previous run's files as %s", ", ".join(moved))
        return moved

    # ---- writers -----------------------------------------------------------------------------------------------
    def write_run_files(self, config: dict, argv: Sequence[str]) -> None:
        """config.json (the resolved config, redacted) and command.txt (the command line, redacted, shell-quoted
        so it can be pasted back). Main rank only."""
        from .redact import redact, redact_argv

        os.makedirs(self.root, exist_ok=True)
        _write_atomic(self.config, json.dumps(redact(config), indent=2, sort_keys=True, default=str) + "\n")
        _write_atomic(self.command, shlex.join(redact_argv(argv)) + "\n")

    def write_ds_configs(self, configs: Mapping[str, dict]) -> list[str]:
        """One `ds_config_<role>.json` per engine (the resolved DeepSpeed configs the engine returns). Main rank."""
        os.makedirs(self.root, exist_ok=True)
        paths = []
        for role, ds_cfg in configs.items():
            _write_atomic(self.ds_config(role), json.dumps(ds_cfg, indent=2, sort_keys=True))
            paths.append(self.ds_config(role))
        return paths


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


# functional forms (the recipes and tests call these with an output_dir)
def holds_run(output_dir: str) -> bool:
    return RunDir(output_dir).holds_run()


def prepare_output_dir(output_dir: str, resume: bool, overwrite: bool, is_main: bool = True) -> list[str]:
    return RunDir(output_dir).prepare(resume, overwrite, is_main)


def write_run_files(output_dir: str, config: dict, argv: Sequence[str]) -> None:
    RunDir(output_dir).write_run_files(config, argv)
