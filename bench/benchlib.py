"""Shared pieces of the benchmarks: model shapes, random-weight model folders, synthetic prompts, per-phase timers,
peak memory, FLOP counts and JSON output. Imports only the standard library at module level (torch, transformers and
rlhf_engine are imported inside functions), so `make_readme.py` and the tests can import it cheaply.

FLOP formula (stated in every result file and in the generated README):

    N          = matmul parameters of a model: every 2-D weight outside embedding tables (attention and MLP
                 projections, OPT's project_in/out, the score head) plus the LM head, counted even when it is tied
                 to the input embedding (its matmul runs either way). Attention-score FLOPs (4 * L^2 * h per layer
                 and sequence) are left out, as in the usual 6*N*T estimate.
    T          = token positions a forward processes, padding included (it is computed): B * (P + R) per batch,
                 P and R the padded prompt and response widths of the rollout buffer.
    generation = 2 * N_actor * B * (P + R)                  (prefill + one token per step, KV cache)
    experience = 2 * (N_actor + N_ref + N_critic + N_reward) * B * (P + R)
    training   = 6 * (N_actor + N_critic) * B * (P + R) * ppo_epochs   (forward + backward, no recomputation)
    TFLOP/s    = the phase's FLOPs on one rank / the phase's wall time, averaged over ranks.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import resource
import subprocess
import sys
import time
from typing import Any, Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

FLOP_FORMULA = (
    "N = matmul parameters (every 2-D weight outside embedding tables, plus the LM head even when tied); "
    "T = B*(P+R) token positions per forward, padding included; generation = 2*N_actor*T; "
    "experience = 2*(N_actor+N_ref+N_critic+N_reward)*T; training = 6*(N_actor+N_critic)*T*ppo_epochs; "
    "attention-score FLOPs left out; TFLOP/s = a rank's FLOPs / wall time, averaged over ranks")

# ---- model shapes ------------------------------------------------------------------------------------------------
# OPT shapes are those of facebook/opt-1.3b and facebook/opt-350m (config.json); weights are random.
SHAPES: dict[str, dict] = {
    "opt-1.3b": dict(hidden_size=2048, num_hidden_layers=24, ffn_dim=8192, num_attention_heads=32,
                     word_embed_proj_dim=2048, do_layer_norm_before=True, vocab_size=50272,
                     max_position_embeddings=2048),
    "opt-350m": dict(hidden_size=1024, num_hidden_layers=24, ffn_dim=4096, num_attention_heads=16,
                     word_embed_proj_dim=512, do_layer_norm_before=False, vocab_size=50272,
                     max_position_embeddings=2048),
    # CPU shapes: the same architecture (OPT, incl. 350m's project_in/out and post-LN), tiny sizes
    "opt-tiny": dict(hidden_size=64, num_hidden_layers=2, ffn_dim=256, num_attention_heads=4, word_embed_proj_dim=64,
                     do_layer_norm_before=True, vocab_size=512, max_position_embeddings=512),
    "opt-tiny-critic": dict(hidden_size=64, num_hidden_layers=2, ffn_dim=256, num_attention_heads=4,
                            word_embed_proj_dim=32, do_layer_norm_before=False, vocab_size=512,
                            max_position_embeddings=512),
    "opt-small": dict(hidden_size=256, num_hidden_layers=4, ffn_dim=1024, num_attention_heads=4,
                      word_embed_proj_dim=256, do_layer_norm_before=True, vocab_size=8192,
                      max_position_embeddings=1024),
    "opt-small-critic": dict(hidden_size=128, num_hidden_layers=4, ffn_dim=512, num_attention_heads=4,
                             word_embed_proj_dim=64, do_layer_norm_before=False, vocab_size=8192,
                             max_position_embeddings=1024),
}
PAD_ID, EOS_ID, BOS_ID = 1, 2, 0  # OPT's own ids: <pad>=1, </s>=2 (eos and bos in OPT), <unk>=3; we use <s>=0


def shape_config(name: str, head: str):
    """transformers OPTConfig for shape `name`; head "causal_lm" or "score" (one label)."""
    from transformers import OPTConfig

    s = dict(SHAPES[name])
    return OPTConfig(**s, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
                     pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID, num_labels=1,
                     enable_bias=True, activation_function="relu", tie_word_embeddings=True)


def make_tokenizer(out_dir: str) -> str:
    """A small WordLevel tokenizer with OPT's special-token ids (<s>=0, <pad>=1, </s>=2, <unk>=3). Its vocabulary is
    smaller than the models': prompts are token ids, never text, and the tokenizer only provides pad/eos ids."""
    if os.path.isfile(os.path.join(out_dir, "tokenizer.json")):
        return out_dir
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": 4 + i for i in range(60)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>", padding_side="left")
    tmp = out_dir + f".tmp{os.getpid()}"
    fast.save_pretrained(tmp)
    _publish(tmp, out_dir)
    return out_dir


def _publish(tmp: str, out: str) -> None:
    """Move a finished folder into place; another process that got there first wins (ranks may race)."""
    import shutil

    try:
        os.replace(tmp, out)
    except OSError:
        if not os.path.isdir(out):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def make_model_folder(models_dir: str, shape: str, head: str, dtype: str = "bf16", seed: int = 0) -> str:
    """A random-weight OPT model of `shape` saved as an HF folder (weights in `dtype`, tokenizer included), cached
    under `models_dir` by a hash of its config. Built on the GPU when there is one (fast init), else on CPU."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    transformers.utils.logging.disable_progress_bar()
    config = shape_config(shape, head)
    key = hashlib.sha1(json.dumps([config.to_dict(), head, dtype, seed], sort_keys=True, default=str)
                       .encode()).hexdigest()[:10]
    out = os.path.join(models_dir, f"{shape}-{head}-{dtype}-{key}")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    tok = make_tokenizer(os.path.join(models_dir, "tokenizer"))
    auto = AutoModelForCausalLM if head == "causal_lm" else AutoModelForSequenceClassification
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            model = auto.from_config(config, dtype=tdtype)
    tmp = out + f".tmp{os.getpid()}"
    model.save_pretrained(tmp)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(tok).save_pretrained(tmp)
    del model
    _publish(tmp, out)
    return out


def matmul_params(path_or_shape: str, head: str) -> int:
    """N of the FLOP formula for a model folder or a shape name (built on the meta device: no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    config = shape_config(path_or_shape, head) if path_or_shape in SHAPES else AutoConfig.from_pretrained(
        path_or_shape, num_labels=1)
    auto = AutoModelForCausalLM if head == "causal_lm" else AutoModelForSequenceClassification
    with torch.device("meta"):
        model = auto.from_config(config)
    total = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding):
            continue
        for p in m.parameters(recurse=False):
            if p.dim() == 2:
                total += p.numel()
    return total


# ---- synthetic prompts -------------------------------------------------------------------------------------------
def synthetic_prompts(n: int, length: int, vocab_size: int, seed: int, fixed: bool = True):
    """`n` prompts of random token ids in [4, vocab): all `length` long (`fixed`, like DeepSpeed-Chat's prompts padded
    to max_prompt_seq_len), or lengths uniform in [length // 4, length]."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = length if fixed else rng.randint(max(1, length // 4), length)
        out.append([rng.randrange(4, vocab_size) for _ in range(k)])
    return out


def synthetic_prompt_data(prompts: list):
    """Pre-tokenized prompts as the data layer's `PromptData`, for `build_trainer(cfg, prompt_data=...)` (no
    `datasets` file needed; everything else of `build_trainer` runs as is)."""
    from rlhf_engine.data.prompts import PromptData, PromptDataset

    ds = PromptDataset([list(p) for p in prompts], [[1] * len(p) for p in prompts], [""] * len(prompts))
    return PromptData(train=ds, eval=None, stats=None)


# ---- device, memory, timing ----------------------------------------------------------------------------------------
def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _vm_hwm_kib() -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            m = re.search(r"VmHWM:\s+(\d+)\s+kB", f.read())
        return int(m.group(1)) if m else None
    except OSError:
        return None


def reset_peak_memory() -> str:
    """Reset this process's peak-memory counter; returns the method that `peak_memory_mib` will read."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return "torch.cuda.max_memory_allocated"
    try:
        with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM (Linux >= 4.0)
            f.write("5")
        return "VmHWM after reset (peak RSS of this interval)"
    except OSError:
        return "getrusage ru_maxrss (peak RSS of the whole process)"


def peak_memory_mib() -> float:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2 ** 20
    hwm = _vm_hwm_kib()
    if hwm is not None:
        return hwm / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def process_peak_mib() -> float:
    """Peak memory of the whole process so far: CUDA max allocated (GPU) or ru_maxrss (CPU)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2 ** 20  # reset per iteration: see callers
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class PhaseTimer:
    """Wall-clock sums per key, filled by wrappers around an RLHFEngine INSTANCE's methods (the library is not
    touched). On GPU each timed call is bracketed by torch.cuda.synchronize(), so a key holds the device time of
    its work; the syncs are the benchmark's own and are absent from normal training."""

    ENGINE_METHODS = ("sample", "actor_logprobs", "ref_logprobs", "critic_values", "reward_scores",
                      "actor_forward", "critic_forward")
    ROLE_METHODS = ("backward", "step")

    def __init__(self):
        self.t: dict[str, float] = {}
        self.n: dict[str, int] = {}

    def reset(self) -> None:
        self.t, self.n = {}, {}

    def wrap(self, key: str, fn: Callable) -> Callable:
        def timed(*a, **k):
            sync()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                sync()
                self.t[key] = self.t.get(key, 0.0) + time.perf_counter() - t0
                self.n[key] = self.n.get(key, 0) + 1

        return timed

    def wrap_role(self, name: str, fn: Callable) -> Callable:
        def timed(role, *a, **k):
            return self.wrap(f"{name}/{role}", lambda: fn(role, *a, **k))()

        return timed

    def instrument(self, engine) -> None:
        for name in self.ENGINE_METHODS:
            setattr(engine, name, self.wrap(name, getattr(engine, name)))
        for name in self.ROLE_METHODS:
            setattr(engine, name, self.wrap_role(name, getattr(engine, name)))


def split_phases(rec: dict, timer: PhaseTimer) -> dict:
    """The trainer's phase times plus the finer splits from the timers (seconds)."""
    t = timer.t
    gen, exp, train = rec["time/generate"], rec["time/experience"], rec["time/train"]
    exp_parts = {k: t.get(k, 0.0) for k in ("actor_logprobs", "ref_logprobs", "critic_values", "reward_scores")}
    actor = t.get("actor_forward", 0.0) + t.get("backward/actor", 0.0) + t.get("step/actor", 0.0)
    critic = t.get("critic_forward", 0.0) + t.get("backward/critic", 0.0) + t.get("step/critic", 0.0)
    return {
        "generation": gen,
        "experience": exp,
        "experience/actor_logprobs": exp_parts["actor_logprobs"],
        "experience/reference": exp_parts["ref_logprobs"],
        "experience/reward": exp_parts["reward_scores"],
        "experience/critic": exp_parts["critic_values"],
        "experience/other": max(0.0, exp - sum(exp_parts.values())),
        "training": train,
        "training/actor": actor,
        "training/critic": critic,
        "training/other": max(0.0, train - actor - critic),
        "training/actor_forward": t.get("actor_forward", 0.0),
        "training/actor_backward": t.get("backward/actor", 0.0),
        "training/actor_step": t.get("step/actor", 0.0),
        "training/critic_forward": t.get("critic_forward", 0.0),
        "training/critic_backward": t.get("backward/critic", 0.0),
        "training/critic_step": t.get("step/critic", 0.0),
    }


def iteration_flops(n: dict, batch: int, width: int, ppo_epochs: int) -> dict:
    """FLOPs of one iteration on one rank (see FLOP_FORMULA). `n` maps role -> matmul params."""
    T = batch * width
    return {
        "generation": 2 * n["actor"] * T,
        "experience": 2 * (n["actor"] + n["reference"] + n["critic"] + n["reward"]) * T,
        "training": 6 * (n["actor"] + n["critic"]) * T * ppo_epochs,
    }


# ---- environment and output ----------------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    import torch

    info = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "python": platform.python_version(), "platform": platform.platform(), "cpu": _cpu_model(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None}
    for mod in ("transformers", "deepspeed", "accelerate"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            info[mod] = f"unavailable ({type(e).__name__})"
    try:
        with open("/proc/meminfo") as f:
            info["ram_gib"] = round(int(re.search(r"MemTotal:\s+(\d+)", f.read()).group(1)) / 2 ** 20, 1)
    except (OSError, AttributeError):
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_count=torch.cuda.device_count(), gpu_memory_gib=round(p.total_memory / 2 ** 30, 1),
                    cuda=torch.version.cuda)
    else:
        info["gpu"] = None
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                            text=True, timeout=10).stdout.strip() or None
        # the measured code: rlhf_engine (the benchmark's own files are the instrument, not the subject)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "rlhf_engine"],
                               cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        info["git_dirty"] = bool(dirty)
    except (OSError, subprocess.SubprocessError):
        info["git_commit"] = None
    return info


def command_line(argv: list) -> str:
    """The command that produced a result, with this checkout's absolute path removed (so it reads the same on any
    machine)."""
    prefix = ROOT.rstrip("/") + "/"
    return " ".join(a.replace(prefix, "") for a in argv)


def cell(text: Any) -> str:
    """Text safe inside a markdown table cell: one line, no '|'."""
    return str(text).strip().splitlines()[0].replace("|", "/") if str(text).strip() else ""


def write_json(path: str, obj: Any) -> None:
    """Atomic write (a reader or a killed run never leaves half a file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=False, default=str)
        f.write("\n")
    os.replace(tmp, path)


def median(xs: list) -> Optional[float]:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    k = len(xs) // 2
    return xs[k] if len(xs) % 2 else (xs[k - 1] + xs[k]) / 2


def fmt(x: Any, digits: int = 3) -> str:
    """A number for a table: 3 significant digits (no scientific notation for ordinary sizes)."""
    if x is None:
        return "–"
    if isinstance(x, str):
        return x
    if isinstance(x, bool):
        return "yes" if x else "no"
    if x == 0:
        return "0"
    ax = abs(x)
    if ax >= 10 ** digits:
        return f"{x:,.0f}"
    from math import floor, log10

    decimals = max(0, digits - 1 - floor(log10(ax)))
    return f"{x:.{decimals}f}"
