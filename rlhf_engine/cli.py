"""Command line and config files generated from the config dataclasses: field name = flag = config-file key.

Role fields take the role as prefix (`--actor_learning_rate`, `--reward_zero_stage`); PPO, generation and batch fields
are flat (`--kl_coef`, `--max_answer_seq_len`, `--generation_batches`). `--config FILE` (JSON or YAML, with the same flat
keys) is read first and flags override it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import typing
from typing import Any, Optional, Sequence

from .config import ROLES, TrainConfig
from .errors import Problems, did_you_mean

_SECTIONS = ("ppo", "generation", "batch")


def _leaves(cfg: TrainConfig) -> dict[str, tuple[Any, dataclasses.Field]]:
    """flat key -> (owner object, field) for every leaf field of the config."""
    out: dict[str, tuple[Any, dataclasses.Field]] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in ROLES:
            for g in dataclasses.fields(value):
                out[f"{f.name}_{g.name}"] = (value, g)
        elif f.name in _SECTIONS:
            for g in dataclasses.fields(value):
                out[g.name] = (value, g)
        else:
            out[f.name] = (cfg, f)
    return out


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


def _arg_type(f: dataclasses.Field, owner: Any):
    hints = typing.get_type_hints(type(owner))
    t = hints[f.name]
    if typing.get_origin(t) is typing.Union:  # Optional[X]
        t = next(a for a in typing.get_args(t) if a is not type(None))
    return t


def build_parser(description: str = "") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default=None, help="JSON or YAML file of flat config keys; flags override it.")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by deepspeed
    groups = {}
    for key, (owner, f) in _leaves(TrainConfig()).items():
        section = type(owner).__name__
        group = groups.setdefault(section, parser.add_argument_group(section, (owner.__doc__ or "").strip()))
        t = _arg_type(f, owner)
        kw: dict[str, Any] = dict(default=argparse.SUPPRESS, help=f.metadata.get("help", ""))
        if t is bool:
            kw.update(type=_bool, nargs="?", const=True, metavar="BOOL")
        elif t is list or typing.get_origin(t) is list:
            kw.update(type=int, nargs="*")
        else:
            kw.update(type=t if t in (int, float, str) else str)
        group.add_argument(f"--{key}", **kw)
    return parser


def _read_config_file(path: str) -> dict:
    with open(path) as fh:
        text = fh.read()
    if path.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of config keys")
    return data


def apply_overrides(cfg: TrainConfig, values: dict, source: str) -> TrainConfig:
    """Set flat keys on cfg; unknown keys are one error with "did you mean"."""
    leaves = _leaves(cfg)
    p = Problems()
    for key, value in values.items():
        if key not in leaves:
            p.add(f"{source}: {key}", value, "unknown key" + did_you_mean(key, leaves))
            continue
        owner, f = leaves[key]
        setattr(owner, f.name, value)
    p.raise_if_any(f"invalid {source}")
    return cfg


def parse_args(argv: Optional[Sequence[str]] = None, description: str = "") -> TrainConfig:
    """argv -> validated TrainConfig (config file first, then flags)."""
    parser = build_parser(description)
    known = {a.dest for a in parser._actions}
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flags = [u.split("=")[0] for u in unknown if u.startswith("--")]
        hints = "; ".join(f"{u}{did_you_mean(u[2:], known)}" for u in flags) or " ".join(unknown)
        parser.error(f"unrecognized arguments: {hints}")
    cfg = TrainConfig()
    ns = vars(args)
    path = ns.pop("config", None)
    ns.pop("local_rank", None)
    if path:
        if not os.path.isfile(path):
            parser.error(f"--config {path}: no such file")
        apply_overrides(cfg, _read_config_file(path), f"config file {path}")
    apply_overrides(cfg, ns, "command line")
    return cfg.validate()


def flat_dict(cfg: TrainConfig) -> dict:
    """The resolved config as flat keys (what a config file holds)."""
    return {k: getattr(owner, f.name) for k, (owner, f) in _leaves(cfg).items()}
