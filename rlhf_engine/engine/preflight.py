"""The model side of a run's plan: every role's path, ZeRO stage and resolved dtype, the tokenizer, the stop tokens and
the generation path, checked before any engine is built (every problem in one error).

Only configs and tokenizers are read here (cheap), never weights. `plan_engine` (PPO) and `plan_model` (steps 1 and 2)
are called once per run, by the run plan (trainer/plan.py); the engines take what they return.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from .. import comm
from ..config import ROLES, RoleConfig, TrainConfig
from ..errors import Problems
from ..hf_fields import max_positions
from .cpu_matmul import NATIVE_BF16_FLAGS, resolve_mode
from .generation.choice import resolve_auto
from .ds_config import load_user_config
from .models import prepare_tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolePlan:
    """Where one role's weights come from and how its engine is placed (`dtype` resolved: never "auto")."""

    path: str
    stage: int
    dtype: str
    train: bool
    matmul: str = "native"  # bf16 on a CPU: "fp32" = Linear layers through the fp32 kernel (engine/cpu_matmul.py)


@dataclass(frozen=True)
class EnginePlan:
    """What `RLHFEngine` builds: one engine per role of `roles` (the reference is skipped when it is the actor's
    disabled adapter), with this tokenizer, for `num_training_steps` optimizer steps of the LR schedule."""

    roles: Mapping[str, RolePlan]
    tokenizer: Any = field(repr=False)
    stop_token_ids: tuple  # a response ends at the first of them (`stop_tokens`: every source, sorted)
    generation_backend: str  # engine/generation BACKENDS name, resolved (hybrid only where it can run)
    num_training_steps: int = 0
    packing: str = "off"  # --packing resolved against the models' sliding windows (`check_packing`): auto may be off
    longest_sequence: int = 0  # max_prompt_seq_len + the response budget: the length the packing probe runs at
    # --rollout_servers: the servers as the plan checked them (generation/servers.py: probe_servers)
    rollout_link: Any = field(default=None, repr=False)


def resolve_dtype(dtype: str, cuda: bool | None = None) -> str:
    """`auto` -> bf16 on a GPU that supports it, fp16 on another GPU, fp32 on CPU; any other value as given."""
    if dtype != "auto":
        return dtype
    import torch

    cuda = torch.cuda.is_available() if cuda is None else cuda
    if not cuda:
        return "fp32"
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


def log_dtypes(roles: Mapping[str, RolePlan], requested: Mapping[str, str],
               cpu_flags: Callable[[], Optional[set]] = lambda: read_cpu_flags()) -> None:
    """One line naming what each `auto` dtype resolved to; for bf16 on a CPU without bf16 instructions (`cpu_flags()`:
    this machine's flags, or None where they cannot be read) one line naming the roles whose Linear layers take the
    fp32 kernel (cpu_bf16_matmul), and a warning naming those left on the slow bf16 kernels."""
    import torch

    cuda = torch.cuda.is_available()
    auto = {r: p.dtype for r, p in roles.items() if requested.get(r) == "auto"}
    if auto:
        where = "CUDA" if cuda else "no CUDA device"
        log.info("dtype auto (%s): %s", where, ", ".join(f"{r} {d}" for r, d in auto.items()))
    bf16 = [r for r, p in roles.items() if p.dtype == "bf16"]
    flags = cpu_flags() if bf16 and not cuda else None
    if flags is None or flags & NATIVE_BF16_FLAGS or comm.rank() != 0:
        return
    widened = [r for r in bf16 if roles[r].matmul == "fp32"]
    slow = [r for r in bf16 if roles[r].matmul != "fp32"]
    if widened:
        log.info("dtype bf16 (%s) on a CPU without bf16 instructions (none of %s): Linear layers multiply in the fp32 "
                 "kernel and round to bf16 (cpu_bf16_matmul; docs/configuration.md)", ", ".join(widened),
                 ", ".join(sorted(NATIVE_BF16_FLAGS)))
    if slow:
        log.warning("dtype bf16 (%s) with cpu_bf16_matmul native on a CPU without bf16 instructions (none of %s): its "
                    "matrix products take slow kernels here, up to 80x the fp32 time (docs/configuration.md, bf16 on "
                    "a CPU); cpu_bf16_matmul auto or fp32 is faster on this machine", ", ".join(slow),
                    ", ".join(sorted(NATIVE_BF16_FLAGS)))


def read_cpu_flags(path: str = "/proc/cpuinfo") -> Optional[set]:
    """This machine's CPU flags (Linux), or None where they cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def resolve_paths(cfg: TrainConfig) -> dict[str, str]:
    """Model path per role. DeepSpeed-Chat conventions: reward defaults to the critic's path; the reference is the
    initial actor; the critic starts from the reward model unless `critic_init_from = actor`."""
    actor = cfg.actor.model_name_or_path
    critic = cfg.critic.model_name_or_path
    reward = cfg.reward.model_name_or_path
    if not critic:
        from_actor = cfg.critic.init_from == "actor" or (cfg.scored_without_model and
                                                          cfg.critic.init_from != "reward")
        critic = actor if from_actor else reward
    if not reward:
        reward = critic
    return {"actor": actor, "reference": cfg.reference.model_name_or_path or actor, "critic": critic,
            "reward": reward}


def resolve_stage(cfg: TrainConfig, role: str) -> int:
    """Explicit stage, else: trained roles 0; reference/reward 3 when their trained counterpart uses 3, else 0."""
    stage = getattr(cfg, role).zero_stage
    if stage is not None:
        return stage
    partner = {"reference": "actor", "reward": "critic"}.get(role)
    if partner is None:
        return 0
    return 3 if (getattr(cfg, partner).zero_stage or 0) == 3 else 0


WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                "pytorch_model.bin.index.json")


def missing_weights(path: str) -> str:
    """'' when `path` is not a local folder (a hub id) or holds Hugging Face weights; else what is missing: no weight
    file at all, or shards a `*.index.json` names that are not there."""
    import json

    folder = os.path.expanduser(path)
    if not os.path.isdir(folder):
        return ""
    names = set(os.listdir(folder))
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if index in names:
            try:
                with open(os.path.join(folder, index)) as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                return f"{index} cannot be read ({type(e).__name__}: {e}); restore the file or re-save the model"
            gone = [s for s in shards if s not in names]
            if gone:
                return (f"{index} names {len(gone)} weight shard(s) that are not in the folder ({', '.join(gone[:3])}"
                        f"{', ...' if len(gone) > 3 else ''}); copy the complete model folder")
            return ""
    if names & set(WEIGHT_FILES) or any(n.endswith(".safetensors") for n in names):
        return ""
    return (f"holds no weights (none of {', '.join(WEIGHT_FILES[:2])}, or sharded *.safetensors with their index); "
            "give a complete Hugging Face model folder (save_pretrained writes config.json and the weights)")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
                   "spiece.model", "sentencepiece.bpe.model")


def missing_tokenizer(path: str) -> str:
    """'' when `path` is not a local folder (a hub id) or holds tokenizer files; else the problem. (Without them
    transformers 5 builds an EMPTY tokenizer from config.json alone, without an error.)"""
    folder = os.path.expanduser(path)
    if not os.path.isdir(folder) or set(os.listdir(folder)) & set(TOKENIZER_FILES):
        return ""
    return (f"holds no tokenizer files (none of {', '.join(TOKENIZER_FILES[:3])}, ...); save the tokenizer there "
            "(tokenizer.save_pretrained) or point the tokenizer_name_or_path flag at a folder that has one")


def plan_engine(cfg: TrainConfig, num_training_steps: int = 0) -> EnginePlan:
    """Resolve and check every role, load the actor's tokenizer (once), decide the generation path; raise one
    `ConfigError` listing all problems. Each step below adds its problems and goes on, so one run reports them all."""
    p = Problems()
    resolve_auto(cfg)  # a config built in code (parse_args resolved it already otherwise)
    paths = resolve_paths(cfg)
    check_required_paths(cfg, paths, p)
    configs = load_role_configs(cfg, paths, p)
    tokenizer, tokenizer_len = load_actor_tokenizer(cfg, paths, configs, p)
    check_vocabularies(cfg, paths, configs, tokenizer_len, p)
    check_reward_tokenizer(cfg, configs, p)
    check_positions(cfg, paths, configs, p)
    check_lora(cfg, configs, p)
    backend, fallback_reasons = plan_generation(cfg, configs, p)
    packing, packing_off = check_packing(cfg, paths, configs, p)
    stop = None
    if tokenizer is not None and "actor" in configs:
        stop = stop_tokens(cfg, paths["actor"], tokenizer, configs["actor"].vocab_size, p)
    plans = plan_roles(cfg, paths, p)
    from .generation.vllm_memory import check_plan as check_vllm_memory

    check_vllm_memory(cfg, configs, plans, backend, longest_sequence(cfg), p)  # on a GPU: the engine fits beside ours
    p.raise_if_any("cannot start: model setup")
    log_dtypes(plans, {r: getattr(cfg, r).dtype or cfg.dtype for r in plans})
    if fallback_reasons:
        log.warning("generation_backend hybrid: the DeepSpeed Hybrid Engine cannot run here ("
                  + "; ".join(fallback_reasons) + "); hybrid_engine_fallback is set, so the actor generates with "
                  "Hugging Face generate")
        backend = "hf"
    if packing_off:
        log.info("packing auto: off, %s", packing_off)
    return EnginePlan(plans, tokenizer, stop, backend, num_training_steps, packing, longest_sequence(cfg))


def check_required_paths(cfg: TrainConfig, paths: dict, p: Problems) -> None:
    if not paths["actor"]:
        p.add("actor_model_name_or_path", "", "give the actor's model folder or hub id")
    if "critic" in cfg.active_roles and not paths["critic"]:
        p.add("critic_model_name_or_path", "", "give a critic (or reward) model folder, or set critic_init_from=actor")


def load_role_configs(cfg: TrainConfig, paths: dict, p: Problems) -> dict:
    """role -> its model's config (roles whose path is missing, unloadable or without weights are left out and
    reported once per path: a path shared by several roles, the reference = the actor by default, is named once)."""
    from transformers import AutoConfig

    configs = {}
    reported = set()
    for role in cfg.active_roles:
        path = paths[role]
        if not path or path in reported:
            continue
        # name the role the user set this path on (the critic defaults to the reward's path, the reference to the
        # actor's)
        field = next((f"{r}_model_name_or_path" for r in ROLES if getattr(cfg, r).model_name_or_path == path),
                     f"{role}_model_name_or_path")
        if path.startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(path)):
            reported.add(path)
            p.add(field, path, "no such folder; give a local model folder or a hub id")
            continue
        try:
            configs[role] = AutoConfig.from_pretrained(path)
        except Exception as e:  # noqa: BLE001  (report any load failure as a user error)
            reported.add(path)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            p.add(field, path, f"cannot load its config.json ({first}); give a folder holding "
                  "a Hugging Face model (config.json + weights) or a reachable hub id")
            continue
        no_weights = missing_weights(path)
        if no_weights:
            reported.add(path)
            p.add(field, path, no_weights)
    return configs


def load_actor_tokenizer(cfg: TrainConfig, paths: dict, configs: dict, p: Problems) -> tuple[Any, Optional[int]]:
    """(the prepared actor tokenizer or None, its length or None)."""
    tok_path = cfg.actor.tokenizer_name_or_path or paths["actor"]
    if not tok_path or "actor" not in configs:
        return None, None
    tok = load_tokenizer_checked(tok_path, "actor_tokenizer_name_or_path", p)
    if tok is None:
        return None, None
    if tok.eos_token_id is None:  # (no pad token is fine: EOS becomes the pad token, logged)
        p.add("actor_tokenizer_name_or_path", tok_path, "the tokenizer has no EOS token: generation stops at "
              "it (and it is the pad token when there is none); give a tokenizer with one")
        return None, len(tok)
    return prepare_tokenizer(tok), len(tok)


def load_tokenizer_checked(tok_path: str, field: str, p: Problems) -> Any:
    """The tokenizer at `tok_path`, or None with the reason added to `p` under `field`."""
    from transformers import AutoTokenizer

    missing = missing_tokenizer(tok_path)
    if missing:
        p.add(field, tok_path, f"cannot load a tokenizer there: {missing}")
        return None
    try:
        return AutoTokenizer.from_pretrained(tok_path)
    except Exception as e:  # noqa: BLE001
        p.add(field, tok_path, f"cannot load a tokenizer there ({type(e).__name__}: {e})")
        return None


def check_vocabularies(cfg: TrainConfig, paths: dict, configs: dict, tokenizer_len: Optional[int],
                       p: Problems) -> None:
    """The actor's tokenizer fits its vocabulary, and every other role shares the actor's vocabulary."""
    if "actor" not in configs:
        return
    vocab = configs["actor"].vocab_size
    if tokenizer_len is not None and tokenizer_len > vocab:
        p.add("actor_tokenizer_name_or_path", cfg.actor.tokenizer_name_or_path or paths["actor"],
              f"tokenizer has {tokenizer_len} tokens but the actor's vocabulary has {vocab}; use the actor's own "
              "tokenizer")
    for role in ("critic", "reward", "reference"):
        if role == "reward" and cfg.reward.tokenizer_name_or_path:
            continue  # its own tokenizer: responses are decoded and re-encoded for it (trainer/reward_shaping.py)
        if role in configs and getattr(configs[role], "vocab_size", vocab) != vocab:
            hint = (" (or give the reward model's own tokenizer with reward_tokenizer_name_or_path: responses are "
                    "then decoded and re-encoded for it)" if role == "reward" else
                    " (the critic reads values at the actor's tokens: with a reward model of another vocabulary "
                    "set critic_init_from actor or give a critic_model_name_or_path)" if role == "critic" else "")
            p.add(f"{role}_model_name_or_path", paths[role], f"vocabulary size {configs[role].vocab_size} differs "
                  f"from the actor's {vocab}; {role} must share the actor's tokenizer{hint}")


def check_reward_tokenizer(cfg: TrainConfig, configs: dict, p: Problems) -> None:
    from transformers import AutoTokenizer

    reward_tok = cfg.reward.tokenizer_name_or_path
    if not reward_tok or "reward" not in configs:
        return
    try:
        tok = AutoTokenizer.from_pretrained(reward_tok)
        if len(tok) > configs["reward"].vocab_size:
            p.add("reward_tokenizer_name_or_path", reward_tok, f"tokenizer has {len(tok)} tokens but the reward "
                  f"model's vocabulary has {configs['reward'].vocab_size}; use the reward model's own tokenizer")
    except Exception as e:  # noqa: BLE001
        p.add("reward_tokenizer_name_or_path", reward_tok, f"cannot load a tokenizer there ({type(e).__name__}: "
              f"{e})")


def check_positions(cfg: TrainConfig, paths: dict, configs: dict, p: Problems) -> None:
    """The longest sequence (prompt + response, or + an episode) fits every model's positions."""
    what = "max_prompt_seq_len + " + ("max_episode_tokens" if cfg.env.on else "max_answer_seq_len")
    seen = set()
    for role, config in configs.items():
        need = cfg.generation.max_prompt_seq_len + cfg.response_budget
        extra = ""
        if role == "actor" and cfg.generation_positions > cfg.response_budget:
            need = cfg.generation.max_prompt_seq_len + cfg.generation_positions
            extra = (" (+ max_answer_seq_len - 1: the hf backend feeds a row at its budget until its batch-mates "
                     "end their turn; generation_backend lean does not)")
        limit = max_positions(config)
        if limit is not None and need > limit and (paths[role], need) not in seen:
            seen.add((paths[role], need))
            p.add(what, need, f"exceeds the {role} model's maximum positions ({limit}){extra}; lower "
                  f"{what.replace(' + ', ' or ')}")


def longest_sequence(cfg: TrainConfig) -> int:
    """The longest sequence a forward sees: the longest prompt and the response (or episode) budget."""
    return cfg.generation.max_prompt_seq_len + cfg.response_budget


def short_windows(cfg: TrainConfig, paths: dict, configs: dict) -> list[tuple[str, int]]:
    """(what it is, the window) per model with a sliding window shorter than the longest sequence (a path shared by
    roles named once). Our packed mask has no window (`packing.sliding_window`), so such a model would attend further
    back in packed rows than in padded ones and in generation."""
    from ..packing import sliding_window

    need = longest_sequence(cfg)
    what = "max_prompt_seq_len + " + ("max_episode_tokens" if cfg.env.on else "max_answer_seq_len")
    found, seen = [], set()
    for role, config in configs.items():
        window = sliding_window(config)
        if window is not None and window < need and paths[role] not in seen:
            seen.add(paths[role])
            found.append((f"the {role} model ({getattr(config, 'model_type', '?')}) attends within a sliding window "
                          f"of {window} tokens, shorter than the longest sequence ({what} = {need}), and the packed "
                          "rows' mask has no window (packed forwards would attend further back than generation does)",
                          window))
    return found


def check_packing(cfg: TrainConfig, paths: dict, configs: dict, p: Problems) -> tuple[str, str]:
    """(--packing resolved against the models' sliding windows, why auto turned off or ''): on with a window shorter
    than the longest sequence is a problem naming the flag and the window; auto turns off; off stays off. The
    start-up probe (engine/packed_forward.py) checks the rest, on the engines."""
    setting = cfg.engine.packing
    found = short_windows(cfg, paths, configs) if setting != "off" else []
    lengths = "max_prompt_seq_len or " + ("max_episode_tokens" if cfg.env.on else "max_answer_seq_len")
    if setting == "on":
        for why, window in found:
            p.add("packing", setting, f"{why}; set packing off (or auto, which turns it off here), or lower {lengths} "
                  f"until their sum is at most {window}")
    return ("off", found[0][0]) if found else (setting, "")


def check_lora(cfg: TrainConfig, configs: dict, p: Problems) -> None:
    for role in cfg.trained_roles:
        rc = getattr(cfg, role)
        config = configs.get(role) or (configs.get("actor") if role == "critic" and cfg.critic.init_from == "actor"
                                       else None)
        if rc.lora_dim and config is not None:
            check_lora_targets(p, rc, config, scalar=role == "critic", prefix=f"{role}_")


def plan_generation(cfg: TrainConfig, configs: dict, p: Problems) -> tuple[str, list]:
    """(the requested generation backend, why the Hybrid Engine cannot run when hybrid_engine_fallback lets the
    actor generate with Hugging Face instead: empty otherwise)."""
    from .generation import BACKENDS

    backend, backend_field = cfg.engine.requested_backend
    fallback_reasons: list = []
    if backend not in BACKENDS:
        p.add(backend_field, backend, f"no such generation backend; choose one of {', '.join(BACKENDS)}")
    elif backend == "hybrid" and "actor" in configs:
        reasons = hybrid_engine_reasons(cfg, configs["actor"])
        if reasons and not cfg.engine.hybrid_engine_fallback:
            p.add(backend_field, cfg.engine.enable_hybrid_engine if backend_field == "enable_hybrid_engine" else
                  backend, "the DeepSpeed Hybrid Engine cannot run here: " + "; ".join(reasons) + ". Use "
                  "--generation_backend hf, or hybrid_engine_fallback true to generate with Hugging Face instead "
                  "(logged as a warning)")
        fallback_reasons = reasons
    elif "actor" in configs and not cfg.rollout.servers_on:
        # rollout servers are checked by the plan's probe instead (they run the engine, not this process)
        for reason in BACKENDS[backend].unavailable(configs["actor"]):
            p.add(backend_field, backend, reason)
    if "actor" in configs:
        from .generation.vllm_tp import local_world_size, tp_problems

        for name, value, fix in tp_problems(cfg.engine.vllm_tensor_parallel_size, comm.world_size(), backend,
                                            configs["actor"], cfg.rollout.servers_on, local_world_size()):
            p.add(name, value, fix)
    if backend in BACKENDS and cfg.ppo.rollout_correction != "none" and not BACKENDS[backend].gives_logprobs:
        p.add("rollout_correction", cfg.ppo.rollout_correction, f"needs the generation-time log-probs, and the "
              f"{backend} generation backend gives none; set none, or generate with lean or hf")
    return backend, fallback_reasons


def plan_role(rc: RoleConfig, path: str, stage: int, dtype: str, train: bool) -> RolePlan:
    """One role's plan, its `cpu_bf16_matmul` resolved for this machine (engine/cpu_matmul.py)."""
    import torch

    cuda = torch.cuda.is_available()
    flags = read_cpu_flags() if dtype == "bf16" and not cuda else None
    return RolePlan(path, stage, dtype, train, resolve_mode(rc.cpu_bf16_matmul, dtype, cuda, flags))


def plan_roles(cfg: TrainConfig, paths: dict, p: Problems) -> dict:
    """role -> RolePlan (path, ZeRO stage, dtype, trained), each placement checked."""
    plans = {}
    for role in cfg.active_roles:
        stage = resolve_stage(cfg, role)
        train = role in cfg.trained_roles
        rc = getattr(cfg, role)
        check_placement(p, rc, stage, train, prefix=f"{role}_", name=role)
        plans[role] = plan_role(rc, paths[role], stage, resolve_dtype(rc.dtype or cfg.dtype), train)
    return plans


def end_of_turn_token(tokenizer) -> int | None:
    """The token the chat template closes an assistant turn with (rendering a one-word turn: the first special token
    after the word), or None when the template has none."""
    word = "Paris"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "Capital of France?"},
                                              {"role": "assistant", "content": word}], tokenize=False)
    except Exception:  # noqa: BLE001  (no template, or one that needs other fields)
        return None
    tail = text[text.rfind(word) + len(word):]
    special = set(tokenizer.all_special_ids) | {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
    for tid in tokenizer(tail, add_special_tokens=False)["input_ids"]:
        if tid in special:
            return int(tid)
    return None


def model_eos_ids(path: str) -> list[int]:
    """`eos_token_id` of the model's generation_config (an int or a list), [] when it has none."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except (OSError, ValueError):
        return []
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


_logged_stops: set = set()


def stop_tokens(cfg: TrainConfig, actor_path: str, tokenizer, vocab_size: int, p: Problems) -> tuple:
    """The tokens that end a response (sorted): the tokenizer's EOS, the model's generation_config eos_token_id(s),
    the chat template's end-of-turn token (with use_chat_template) and --stop_token_ids; logged once. An id outside
    the actor's vocabulary is a problem naming stop_token_ids."""
    sources = {"tokenizer EOS": [int(tokenizer.eos_token_id)], "model generation_config": model_eos_ids(actor_path),
               "stop_token_ids": [int(t) for t in cfg.generation.stop_token_ids]}
    if cfg.data.use_chat_template:
        eot = end_of_turn_token(tokenizer)
        sources["chat template end of turn"] = [] if eot is None else [eot]
    bad = [t for t in sources["stop_token_ids"] if t >= vocab_size]
    if bad:
        p.add("stop_token_ids", bad, f"outside the actor's vocabulary (size {vocab_size}); give token ids below it")
    stop = tuple(sorted({t for ids in sources.values() for t in ids if t < vocab_size}))
    line = "; ".join(f"{k} {v}" for k, v in sources.items() if v)
    if line not in _logged_stops:
        _logged_stops.add(line)
        log.info("stop tokens: %s -> %d ids", line if len(line) < 300 else line[:300] + " ...", len(stop))
    return stop


def check_placement(p: Problems, rc: RoleConfig, stage: int, train: bool, prefix: str, name: str) -> None:
    """Problems of one engine's placement: ZeRO stage vs eval-only, offload vs stage, the user's ds_config file.
    `prefix` is the flag prefix of the role's fields (`actor_`, or '' for the one model of SFT / reward training)."""
    if not train and stage in (1, 2):
        p.add(f"{prefix}zero_stage", stage, "eval-only engines must use ZeRO stage 0 or 3")
    # DeepSpeed silently ignores offload settings at stages that cannot offload: the user would think memory
    # is saved when it is not.
    if train and rc.offload is True and stage == 0:
        p.add(f"{prefix}offload", True, f"optimizer offload needs ZeRO stage 1, 2 or 3 and {name} runs at stage "
              f"0: set {prefix}zero_stage (or drop {prefix}offload)")
    if not train and rc.offload is True and stage != 3:
        p.add(f"{prefix}offload", True, f"an eval-only role offloads its parameters, which needs ZeRO stage 3, and "
              f"{name} runs at stage {stage}: set {prefix}zero_stage 3 (or drop {prefix}offload)")
    if rc.offload_params is True and stage != 3:
        p.add(f"{prefix}offload_params", True, f"parameter offload needs ZeRO stage 3 and {name} runs at stage "
              f"{stage}: set {prefix}zero_stage 3 (or drop {prefix}offload_params)")
    if rc.ds_config:
        # checked here, not when the engine is built: one error before any weights are loaded
        load_user_config(rc.ds_config, f"{prefix}ds_config", p)


def plan_model(rc: RoleConfig, need_positions: int, name: str = "model") -> tuple[RolePlan, Any]:
    """Resolve and check the one trained model of an SFT or reward-model run (flat flags: `model_name_or_path`,
    `zero_stage`, ...): its config and tokenizer load, the tokenizer fits the vocabulary and has an EOS token,
    `need_positions` (prompt + response tokens) fits the model, and the placement is valid. Raises one `ConfigError`
    listing every problem; reads no weights. Returns (its `RolePlan`, the prepared tokenizer)."""
    from transformers import AutoConfig

    p = Problems()
    path = rc.model_name_or_path
    config = None
    if not path:
        p.add("model_name_or_path", "", "give a local model folder or hub id")
    elif path.startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(path)):
        p.add("model_name_or_path", path, "no such folder; give a local model folder or a hub id")
    else:
        try:
            config = AutoConfig.from_pretrained(path)
        except Exception as e:  # noqa: BLE001  (report any load failure as a user error)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            p.add("model_name_or_path", path, f"cannot load its config.json ({first}); give a folder holding a "
                  "Hugging Face model (config.json + weights) or a reachable hub id")
        else:
            no_weights = missing_weights(path)
            if no_weights:
                p.add("model_name_or_path", path, no_weights)
    tok_path = rc.tokenizer_name_or_path or path
    if config is not None:
        tok = load_tokenizer_checked(tok_path, "tokenizer_name_or_path", p)
        if tok is not None:
            if tok.eos_token_id is None:
                p.add("tokenizer_name_or_path", tok_path, "the tokenizer has no EOS token: every response ends with "
                      "it (PPO stops generating at it); give a tokenizer with one")
            if len(tok) > config.vocab_size:
                p.add("tokenizer_name_or_path", tok_path, f"tokenizer has {len(tok)} tokens but the model's "
                      f"vocabulary has {config.vocab_size}; use the model's own tokenizer")
        limit = max_positions(config)
        if limit is not None and need_positions > limit:
            p.add("max_prompt_seq_len + max_answer_seq_len", need_positions, f"exceeds the model's maximum positions "
                  f"({limit}); lower max_prompt_seq_len or max_answer_seq_len")
    stage = rc.zero_stage if rc.zero_stage is not None else 0
    check_placement(p, rc, stage, True, prefix="", name=name)
    p.raise_if_any("cannot start: model setup")
    plan = plan_role(rc, path, stage, resolve_dtype(rc.dtype or "auto"), True)
    log_dtypes({name: plan}, {name: rc.dtype or "auto"})
    return plan, prepare_tokenizer(tok)


# ---- LoRA, EMA, reference from the adapter ---------------------------------------------------------------------------
def check_lora_targets(p: Problems, rc: RoleConfig, config, scalar: bool, prefix: str) -> None:
    """`lora_target_modules` must match layers of the model: checked on a weightless (meta-device) copy built from
    its config."""
    from .models import lora_config_for, weightless_model

    model = weightless_model(config, scalar)
    if model is None:  # an architecture we cannot build weightless: checked when the engine is built
        return
    try:
        lora_config_for(model, rc.lora_dim, rc.lora_alpha, rc.lora_dropout, rc.lora_target_modules)
    except ValueError as e:
        p.add(f"{prefix}lora_target_modules", rc.lora_target_modules, str(e))


@functools.lru_cache(maxsize=1)
def hybrid_engine_model_types() -> frozenset:
    """Hugging Face model types with a DeepSpeed inference container (the layer classes of DeepSpeed's
    `replace_policies`, which the Hybrid Engine swaps in for generation)."""
    from deepspeed.module_inject.replace_policy import replace_policies

    types = set()
    for policy in replace_policies:
        try:
            policy(None)  # sets the policy's _orig_layer_class (imports the transformers class if it exists)
        except Exception:  # noqa: BLE001  (a policy whose transformers class is gone)
            continue
        classes = getattr(policy, "_orig_layer_class", None)
        for cls in classes if isinstance(classes, list) else [classes]:
            parts = getattr(cls, "__module__", "").split(".")
            if len(parts) >= 3 and parts[:2] == ["transformers", "models"]:
                types.add(parts[2])
    return frozenset(types)


def hybrid_engine_reasons(cfg: TrainConfig, actor_config, on_gpu: bool | None = None) -> list[str]:
    """Why the DeepSpeed Hybrid Engine cannot run for this actor (an empty list: it can). `on_gpu` defaults to
    `torch.cuda.is_available()`."""
    import torch

    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    reasons = []
    if not on_gpu:
        reasons.append("no CUDA device (its inference kernels are GPU-only: on CPU deepspeed.initialize fails with "
                       "'This op had not been implemented on CPU backend')")
    model_type = getattr(actor_config, "model_type", None)
    supported = hybrid_engine_model_types()
    if model_type not in supported:
        reasons.append(f"the actor's architecture {model_type!r} has no DeepSpeed inference container (supported: "
                       f"{', '.join(sorted(supported))})")
    if cfg.engine.inference_tp_size > 1:
        reasons.append(f"inference_tp_size {cfg.engine.inference_tp_size} > 1: the Hybrid Engine then generates on "
                       "the rows of every tensor-parallel rank, which the generation-time log-prob recorder does not "
                       "map back; use 1")
    if cfg.actor.lora_dim:
        reasons.append("the actor has a LoRA adapter (actor_lora_dim > 0): the Hybrid Engine fuses only "
                       "DeepSpeed-Chat's own LoRA layers, not peft's")
    return reasons
