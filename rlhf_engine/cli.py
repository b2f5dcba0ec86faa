"""Command line and config files generated from the config dataclasses: field name = flag = config-file key.

Role fields take the role as prefix (`--actor_learning_rate`, `--reward_zero_stage`); PPO, generation, batch, data and
logging fields are flat (`--kl_coef`, `--max_answer_seq_len`, `--generation_batches`, `--data_path`). `--config FILE`
(JSON or YAML, with the same flat keys) is read first and flags override it.

DeepSpeed-Chat's flags that set several fields at once are accepted as aliases (`ALIASES`: `--offload`,
`--offload_reference_model`, `--offload_reward_model`, `--num_warmup_steps`, `--lr_scheduler_type`), on the command
line and in config files, wherever the config class has their target fields and no field of the same name. Within
one source the alias is applied first, so a specific key wins (`--offload --critic_offload false`); the resolved
config (`flat_dict`, config.json) holds the target fields only.

The same machinery serves every entry point: `build_parser` / `parse_args` take the config class (`TrainConfig` for
PPO, `SFTConfig`, `RewardTrainConfig`). A nested section's flags are prefixed by its field's `flag_prefix` metadata
(default: `<field>_` for a `RoleConfig`, nothing otherwise) and its `skip_flags` metadata leaves fields out.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import typing
from typing import Any, Callable, Optional, Sequence

from . import signals
from .config import TrainConfig, apply_estimator_defaults, flat_fields
from .config.rollout import RETIRED
from .errors import (CLEAN_EXIT_CODES, EXIT_FAILED, EXIT_OK, EXIT_USER_ERROR, ConfigError, Problems,
                     TrainingStopped, did_you_mean)


# DeepSpeed-Chat flag -> (the flat keys it sets, what it means there)
ALIASES: dict[str, tuple[tuple[str, ...], str]] = {
    "offload": (("actor_offload", "critic_offload"), "optimizer state of the actor and the critic offloaded to CPU "
                "(their ZeRO stage must be 1, 2 or 3)"),
    "offload_reference_model": (("reference_offload",), "the reference model's parameters offloaded to CPU (needs "
                                "reference_zero_stage 3)"),
    "offload_reward_model": (("reward_offload",), "the reward model's parameters offloaded to CPU (needs "
                             "reward_zero_stage 3)"),
    "num_warmup_steps": (("actor_num_warmup_steps", "critic_num_warmup_steps"), "warm-up optimizer steps of the "
                         "actor's and the critic's schedule"),
    "data_output_path": (("data_cache_dir",), "where the processed data is kept; like DeepSpeed-Chat's, it should be "
                         "node-local storage"),
    "lr_scheduler_type": (("actor_lr_scheduler_type", "critic_lr_scheduler_type"), "learning-rate schedule of the "
                          "actor and the critic"),
}


def aliases_of(cfg: Any) -> dict[str, tuple[str, ...]]:
    """The aliases that apply to a config instance: every target is one of its keys and the alias name is not."""
    keys = flat_fields(cfg)
    return {a: targets for a, (targets, _) in ALIASES.items() if a not in keys and all(t in keys for t in targets)}


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict:
    """A config class's resolved field types (resolving them is slow: once per class, not per field)."""
    return typing.get_type_hints(cls)


def _arg_type(f: dataclasses.Field, owner: Any):
    t = _hints(type(owner))[f.name]
    if typing.get_origin(t) is typing.Union:  # Optional[X]
        t = next(a for a in typing.get_args(t) if a is not type(None))
    return t


def _is_optional(f: dataclasses.Field, owner: Any) -> bool:
    t = _hints(type(owner))[f.name]
    return typing.get_origin(t) is typing.Union and type(None) in typing.get_args(t)


def _or_none(t):
    """argparse type for Optional[t] fields: 'none' / 'null' give None (the way back to the default)."""
    def parse(s: str):
        return None if s.lower() in ("none", "null") else t(s)

    parse.__name__ = t.__name__  # argparse names the type in its error messages
    return parse


def _coerce(value: Any, f: dataclasses.Field, owner: Any) -> Any:
    """A config-file value -> the field's type, as argparse does for flags (YAML reads `1e-6` as a string).

    Raises ValueError when the value cannot be one of the field's type.
    """
    t = _arg_type(f, owner)
    if value is None:
        if _is_optional(f, owner):
            return None
        raise ValueError("null is not allowed here")
    if t is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return _bool(value)
            except argparse.ArgumentTypeError as e:
                raise ValueError(str(e)) from None
    elif t is float:
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            return float(value)
    elif t is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            return int(value.strip())
    elif t is str:
        if isinstance(value, str):
            return value
    elif t is list or typing.get_origin(t) is list:
        if isinstance(value, (list, tuple)):
            return list(value)
    else:
        return value
    raise ValueError(f"expected {getattr(t, '__name__', t)}, got {type(value).__name__}")


def build_parser(description: str = "", config_cls: type = TrainConfig) -> argparse.ArgumentParser:
    """The argument parser of `config_cls` (one flag per leaf field, grouped by section)."""
    # allow_abbrev=False: `--ppo 2` must not silently mean --ppo_epochs (config-file keys have no abbreviations either)
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default=None, help="JSON or YAML file of flat config keys; flags override it.")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by deepspeed
    groups = {}
    cfg = config_cls()
    for key, (owner, f, section, doc) in flat_fields(cfg).items():
        if section not in groups:
            groups[section] = parser.add_argument_group(section, doc.replace("%", "%%"))
        group = groups[section]
        t = _arg_type(f, owner)
        # defaults are SUPPRESSed (only given flags override the config file), so the help states them itself
        text = f"{f.metadata.get('help', '')} (default: {getattr(owner, f.name)!r})".replace("%", "%%")
        kw: dict[str, Any] = dict(default=argparse.SUPPRESS, help=text)
        if t is bool:
            kw.update(type=_bool, nargs="?", const=True, metavar="BOOL")
        elif t is list or typing.get_origin(t) is list:
            kw.update(type=int, nargs="*")
        else:
            t = t if t in (int, float, str) else str
            kw.update(type=_or_none(t) if _is_optional(f, owner) else t)
        group.add_argument(f"--{key}", **kw)
    aliases = aliases_of(cfg)
    if aliases:
        group = parser.add_argument_group("DeepSpeed-Chat aliases", "DeepSpeed-Chat's flag names; each sets the "
                                          "fields it names (a flag naming one of those fields as well wins).")
        leaves = {k: (o, f) for k, (o, f, _, _) in flat_fields(cfg).items()}
        for alias, targets in aliases.items():
            owner, f = leaves[targets[0]]
            t = _arg_type(f, owner)
            text = f"= {' '.join('--' + x for x in targets)}: {ALIASES[alias][1]}."
            kw = dict(default=argparse.SUPPRESS, help=text.replace("%", "%%"))
            if t is bool:
                kw.update(type=_bool, nargs="?", const=True, metavar="BOOL")
            else:
                kw.update(type=t if t in (int, float, str) else str)
            group.add_argument(f"--{alias}", **kw)
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


def apply_overrides(cfg: Any, values: dict, source: str, given: Optional[set] = None) -> Any:
    """Set flat keys on cfg; unknown keys are one error with "did you mean". Aliases (`ALIASES`) are expanded first,
    so a key of the same source naming one of their targets wins. `given` collects the flat keys set."""
    leaves = {k: (o, f) for k, (o, f, _, _) in flat_fields(cfg).items()}
    aliases = aliases_of(cfg)
    items = [(t, value, f"{key} (alias of {', '.join(aliases[key])})") for key, value in values.items()
             if key in aliases for t in aliases[key]]
    items += [(key, value, key) for key, value in values.items() if key not in aliases]
    p = Problems()
    for key, value, name in items:
        if key not in leaves:
            p.add(f"{source}: {key}", value, RETIRED.get(key) or
                  "unknown key" + did_you_mean(key, list(leaves) + list(aliases)))
            continue
        owner, f = leaves[key]
        try:
            value = _coerce(value, f, owner)
        except ValueError as e:
            p.add(f"{source}: {name}", value, str(e))
            continue
        setattr(owner, f.name, value)
        if given is not None:
            given.add(key)
    p.raise_if_any(f"invalid {source}")
    return cfg


def parse_args(argv: Optional[Sequence[str]] = None, description: str = "", config_cls: type = TrainConfig) -> Any:
    """argv -> validated `config_cls` instance (TrainConfig by default; config file first, then flags)."""
    parser = build_parser(description, config_cls)
    known = {a.dest for a in parser._actions}
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flags = [u.split("=")[0] for u in unknown if u.startswith("--")]
        hints = "; ".join(f"{u}: {RETIRED[u[2:]]}" if u[2:] in RETIRED else f"{u}{did_you_mean(u[2:], known)}"
                          for u in flags) or " ".join(unknown)
        parser.error(f"unrecognized arguments: {hints}")
    cfg = config_cls()
    ns = vars(args)
    path = ns.pop("config", None)
    ns.pop("local_rank", None)
    given: set = set()
    if path:
        if not os.path.isfile(path):
            parser.error(f"--config {path}: no such file")
        apply_overrides(cfg, _read_config_file(path), f"config file {path}", given)
    apply_overrides(cfg, ns, "command line", given)
    if isinstance(cfg, TrainConfig):  # the estimator family's defaults, where the run set nothing itself
        from .engine.generation.choice import resolve_auto  # no deepspeed import: the backend's defaults need it

        resolve_auto(cfg)
        apply_estimator_defaults(cfg, given)
    return cfg.validate()


def run_main(argv: Optional[Sequence[str]], description: str, config_cls: type, run: Callable[..., Any],
             hooks: Any = None) -> int:
    """The body of every launch script: parse `argv` (default `sys.argv[1:]`) into `config_cls`, call
    `run(cfg, argv, hooks)` (`hooks`: hooks.TestHooks, None in a real run) and map its outcome to an exit code of `errors.EXIT_CODES`, the only place that does: a user
    error (`ConfigError`) is printed, code 2; training stopped on every rank together (`TrainingStopped`: too many
    skipped steps, a non-finite value, a preemption: 75) prints its message and gives its own code; a collective
    operation that timed out or lost its peer (another rank stalled or died), or a reward function that raised,
    prints its traceback and one `error:` line saying so, code 1; anything else propagates."""
    argv = sys.argv[1:] if argv is None else list(argv)
    signals.install()  # 'auto' from now on (SIGUSR1; SIGTERM under SLURM): noted, answered at the next boundary
    try:
        return _run(argv, description, config_cls, run, hooks)
    finally:
        signals.uninstall()  # in-process callers (tests, notebooks) get their own handlers back


def _run(argv: list, description: str, config_cls: type, run: Callable[..., Any], hooks: Any) -> int:
    cfg = None
    try:
        cfg = parse_args(argv, description=description, config_cls=config_cls)
        signals.install(cfg.run.preempt_signals)  # the run's own set ('auto' was in place while parsing)
        run(cfg, argv, hooks)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except TrainingStopped as e:  # every rank stops together, each with this message (trainer/guards.py)
        clean = e.exit_code in CLEAN_EXIT_CODES  # preempted: a complete checkpoint, not an error
        print(f"{'' if clean else 'error: '}{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except Exception as e:  # noqa: BLE001  (only collective failures are handled; the rest is re-raised)
        from .engine.distributed import describe_collective_failure
        from .rewards.loader import RewardFunctionError

        msg = describe_collective_failure(e, cfg.run.dist_timeout_minutes if cfg is not None else None)
        if isinstance(e, RewardFunctionError):
            from .comm import rank as this_rank

            msg = str(e) if str(e).startswith("rank ") else f"rank {this_rank()}: {e}"  # the trainer may name it
        import traceback

        if not msg:
            from . import comm

            if comm.initialized() and comm.world_size() > 1:
                # one rank's own error (a bug, a failing generate call): its peers may already wait inside a
                # collective, so this process ends now, skipping exit handlers that could join one, and the launcher
                # ends the job (deepspeed and torchrun stop every rank when one exits non-zero)
                traceback.print_exc()
                print(f"error: rank {comm.rank()}: {type(e).__name__}: {e} (this rank ends the job: its peers may be "
                      "waiting for it in a collective)", file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(EXIT_FAILED)
            raise
        traceback.print_exc()
        print(f"error: {msg}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    return EXIT_OK


def freeze_startup() -> None:
    """The start of a launch script's `__main__` (never in-process: frozen objects are never collected): collect,
    then move what is alive (the imported modules, torch's and transformers' included, which live to the end of the
    process) to the collector's permanent generation, out of every later full collection's scan. DeepSpeed collects
    explicitly in its ZeRO set-up, and each full collection scanned ~400k objects of the imports (about 0.2 s);
    measured on 2-rank tiny PPO runs: 1-2 s of CPU (about 10%) less per launch."""
    import gc

    gc.collect()
    gc.freeze()


def exit_process(rc: int) -> None:
    """The end of a launch script's `__main__` (never in-process): tear the process group down on every rank
    together, then exit with `rc`. A clean code (`errors.CLEAN_EXIT_CODES`) means every rank got here: a barrier
    first, so no gloo rank aborts after a complete run while its peer is already gone ('terminate called without an
    active exception', exit code -6, seen in 2 of 8 two-rank launches on a loaded machine)."""
    from .comm import shutdown

    shutdown(ok=rc in CLEAN_EXIT_CODES)
    sys.exit(rc)
