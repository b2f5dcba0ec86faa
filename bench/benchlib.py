"""Shared pieces of the benchmarks: model shapes and presets, random-weight model folders, synthetic prompts, phase
timers, peak memory, FLOP counts, machine info and output. Only the standard library is imported at module level (torch,
transformers and rlhf_engine inside functions), so `make_readme.py` and the tests import it cheaply.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import resource
import statistics
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

# OPT shapes of facebook/opt-1.3b and opt-350m (their config.json), and small CPU shapes of the same architecture
# (350m's project_in/out and post-LN included); the weights are always random.
SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "ffn_dim", "num_attention_heads", "word_embed_proj_dim",
              "do_layer_norm_before", "vocab_size", "max_position_embeddings")
SHAPES: dict[str, dict] = {name: dict(zip(SHAPE_KEYS, v)) for name, v in {
    "opt-1.3b": (2048, 24, 8192, 32, 2048, True, 50272, 2048),
    "opt-350m": (1024, 24, 4096, 16, 512, False, 50272, 2048),
    "opt-tiny": (64, 2, 256, 4, 64, True, 512, 512),
    "opt-tiny-critic": (64, 2, 256, 4, 32, False, 512, 512),
    "opt-small": (256, 4, 1024, 4, 256, True, 8192, 1024),
    "opt-small-critic": (128, 4, 512, 4, 64, False, 8192, 1024),
}.items()}
# preset: actor shape, critic/reward shape, P, R, rollouts per iteration (all ranks), training micro-batch, dtype
PRESETS = {
    "cpu-tiny": dict(actor="opt-tiny", critic="opt-tiny-critic", prompt_len=16, answer_len=16, global_batch=8,
                     micro_batch=4, dtype="fp32"),
    "cpu-small": dict(actor="opt-small", critic="opt-small-critic", prompt_len=64, answer_len=64, global_batch=8,
                      micro_batch=4, dtype="fp32"),
    # DeepSpeed-Chat's single-GPU OPT example: 1.3B actor, 350M critic/reward, 256 + 256 tokens, batch 16
    "opt-1.3b": dict(actor="opt-1.3b", critic="opt-350m", prompt_len=256, answer_len=256, global_batch=16,
                     micro_batch=8, dtype="bf16"),
}
PAD_ID, EOS_ID, BOS_ID = 1, 2, 0  # OPT's own ids: <s>=0, <pad>=1, </s>=2


def add_common_args(p, preset: str = "cpu-tiny", iterations: int = 3) -> None:
    """The arguments every launch of ppo_iteration.py takes, also passed through by scaling.py."""
    p.add_argument("--preset", choices=sorted(PRESETS), default=preset)
    p.add_argument("--warmup", type=int, default=1, help="warm-up iterations, reported but not summarized")
    p.add_argument("--iterations", type=int, default=iterations, help="measured iterations (K)")
    p.add_argument("--work-dir", default=os.environ.get("BENCH_WORK_DIR", os.path.join(
        os.environ.get("TMPDIR", "/tmp"), "rlhf_bench")), help="model folders and run folders (cached)")
    p.add_argument("--out", required=True, help="JSON result file")


# ---- models and prompts -------------------------------------------------------------------------------------------
def shape_config(name: str):
    from transformers import OPTConfig

    return OPTConfig(**SHAPES[name], dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
                     pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID, num_labels=1,
                     enable_bias=True, activation_function="relu", tie_word_embeddings=True)


def _publish(tmp: str, out: str) -> None:
    """Move a finished folder into place; ranks may race, and the first one wins."""
    import shutil

    try:
        os.replace(tmp, out)
    except OSError:
        if not os.path.isdir(out):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def make_tokenizer(out_dir: str) -> str:
    """A WordLevel tokenizer with OPT's special-token ids: prompts are token ids, so it only supplies pad/eos."""
    if os.path.isfile(os.path.join(out_dir, "tokenizer.json")):
        return out_dir
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": 4 + i for i in range(60)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tmp = out_dir + f".tmp{os.getpid()}"
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>", padding_side="left").save_pretrained(tmp)
    _publish(tmp, out_dir)
    return out_dir


def make_model_folder(models_dir: str, shape: str, head: str, dtype: str = "bf16", seed: int = 0) -> str:
    """A random-weight OPT model ("causal_lm" or "score" head) saved as an HF folder with its tokenizer, cached under
    `models_dir` by a hash of its config. Initialised on the GPU when there is one (much faster than on CPU)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    config = shape_config(shape)
    key = hashlib.sha1(json.dumps([config.to_dict(), head, dtype, seed], sort_keys=True, default=str)
                       .encode()).hexdigest()[:10]
    out = os.path.join(models_dir, f"{shape}-{head}-{dtype}-{key}")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    tok = make_tokenizer(os.path.join(models_dir, "tokenizer"))
    auto = AutoModelForCausalLM if head == "causal_lm" else AutoModelForSequenceClassification
    tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = auto.from_config(config, dtype=tdtype)
    tmp = out + f".tmp{os.getpid()}"
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(tok).save_pretrained(tmp)
    _publish(tmp, out)
    return out


def model_folders(models_dir: str, actor: str, critic: str, dtype: str) -> dict:
    """The actor and critic/reward folders; local rank 0 builds them while the node's other ranks wait."""
    from rlhf_engine.engine import init_distributed
    from rlhf_engine.engine.distributed import barrier

    def build():
        return {"actor": make_model_folder(models_dir, actor, "causal_lm", dtype, seed=0),
                "critic": make_model_folder(models_dir, critic, "score", dtype, seed=1)}

    if init_distributed().local_rank == 0:
        build()
    barrier()
    return build()


def matmul_params(shape: str, head: str) -> int:
    """N of the FLOP formula for a shape (built on the meta device: no memory)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForCausalLM if head == "causal_lm" else AutoModelForSequenceClassification
    with torch.device("meta"):
        model = auto.from_config(shape_config(shape))
    return sum(p.numel() for m in model.modules() if not isinstance(m, torch.nn.Embedding)
               for p in m.parameters(recurse=False) if p.dim() == 2)


def synthetic_prompts(n: int, length: int, vocab_size: int, seed: int, fixed: bool = True) -> list:
    """`n` prompts of random token ids in [4, vocab): all `length` long (`fixed`, like DeepSpeed-Chat's prompts padded
    to max_prompt_seq_len), or of lengths uniform in [length // 4, length]."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(4, vocab_size) for _ in range(length if fixed else rng.randint(max(1, length // 4), length))]
            for _ in range(n)]


def synthetic_prompt_data(prompts: list):
    """Pre-tokenized prompts as the data layer's `PromptData`, for `build_trainer(cfg, prompt_data=...)`."""
    from rlhf_engine.data.prompts import PromptData, PromptDataset

    ds = PromptDataset([list(p) for p in prompts], [[1] * len(p) for p in prompts], [""] * len(prompts))
    return PromptData(train=ds, eval=None, stats=None)


# ---- device, memory, timing -----------------------------------------------------------------------------------------
def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device_used_mib() -> Optional[float]:
    """What the whole GPU holds now, every allocator's share (the driver's total - free: torch's caching allocator,
    vLLM's own pools, NCCL), in MiB; None on a CPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2 ** 20


def reset_peak_memory() -> str:
    """Reset this process's peak-memory counter; returns what `peak_memory_mib` will read."""
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
    try:
        with open("/proc/self/status") as f:
            return int(re.search(r"VmHWM:\s+(\d+)\s+kB", f.read()).group(1)) / 1024
    except (OSError, AttributeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class PhaseTimer:
    """Wall-clock sums per key, from wrappers around one RLHFEngine INSTANCE's methods (the library is untouched).
    On GPU each timed call is bracketed by torch.cuda.synchronize(), so a key holds the device time of its work;
    these syncs are the benchmark's own and absent from normal training."""

    ENGINE_METHODS = ("sample", "actor_logprobs", "ref_logprobs", "critic_values", "reward_scores",
                      "actor_forward", "critic_forward")
    ROLE_METHODS = ("backward", "step")  # keyed "<method>/<role>"

    def __init__(self, engine):
        self.t: dict[str, float] = {}
        self.n: dict[str, int] = {}
        self.used: dict[str, float] = {}  # GPU: the most the device held at the end of a key's calls (MiB)
        for name in self.ENGINE_METHODS:
            setattr(engine, name, self.wrap(lambda *a, _n=name, **k: _n, getattr(engine, name)))
        for name in self.ROLE_METHODS:
            setattr(engine, name, self.wrap(lambda role, *a, _n=name, **k: f"{_n}/{role}", getattr(engine, name)))

    def reset(self) -> None:
        self.t, self.n, self.used = {}, {}, {}

    def wrap(self, key_of: Callable, fn: Callable) -> Callable:
        def timed(*a, **k):
            key = key_of(*a, **k)
            sync()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                sync()
                self.t[key] = self.t.get(key, 0.0) + time.perf_counter() - t0
                self.n[key] = self.n.get(key, 0) + 1
                used = device_used_mib()
                if used is not None:
                    self.used[key] = max(self.used.get(key, 0.0), used)

        return timed

    def split(self, rec: dict) -> dict:
        """The trainer's phase times (`rec`, one `step()` record) plus the finer splits of the timers (seconds)."""
        t = self.t.get
        exp, train = rec["time/experience"], rec["time/train"]
        out = {"generation": rec["time/generate"], "experience": exp,
               "experience/actor_logprobs": t("actor_logprobs", 0.0), "experience/reference": t("ref_logprobs", 0.0),
               "experience/reward": t("reward_scores", 0.0), "experience/critic": t("critic_values", 0.0),
               "training": train}
        out["experience/other"] = max(0.0, exp - sum(out[f"experience/{k}"] for k in (
            "actor_logprobs", "reference", "reward", "critic")))
        for role in ("actor", "critic"):
            parts = {"forward": t(f"{role}_forward", 0.0), "backward": t(f"backward/{role}", 0.0),
                     "step": t(f"step/{role}", 0.0)}
            out[f"training/{role}"] = sum(parts.values())
            out.update({f"training/{role}_{k}": v for k, v in parts.items()})
        out["training/other"] = max(0.0, train - out["training/actor"] - out["training/critic"])
        return out


def iteration_flops(n: dict, batch: int, width: int, ppo_epochs: int) -> dict:
    """FLOPs of one iteration on one rank (FLOP_FORMULA); `n` maps role -> matmul parameters."""
    T = batch * width
    return {"generation": 2 * n["actor"] * T,
            "experience": 2 * (n["actor"] + n["reference"] + n["critic"] + n["reward"]) * T,
            "training": 6 * (n["actor"] + n["critic"]) * T * ppo_epochs}


# ---- environment and output ---------------------------------------------------------------------------------------
def git_commit() -> Optional[str]:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


SIMD_FLAGS = frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8"})


def machine_info() -> dict:
    import torch

    info = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "python": platform.python_version(),
            "platform": platform.platform(), "cpu": platform.processor() or "unknown", "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()], "gpu": None}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        with open("/proc/meminfo") as f:
            info["ram_gib"] = round(int(re.search(r"MemTotal:\s+(\d+)", f.read()).group(1)) / 2 ** 20, 1)
    except (OSError, StopIteration, AttributeError):
        pass
    from rlhf_engine.engine.preflight import read_cpu_flags

    flags = read_cpu_flags()
    if flags is not None:  # what decides the kernels: bf16 is slow without avx512_bf16 / amx_bf16
        info["cpu_flags"] = sorted(flags & SIMD_FLAGS)
    for mod in ("transformers", "deepspeed", "accelerate"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            info[mod] = f"unavailable ({type(e).__name__})"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_count=torch.cuda.device_count(), gpu_memory_gib=round(p.total_memory / 2 ** 30, 1),
                    cuda=torch.version.cuda)
    info["git_commit"] = git_commit()
    # only rlhf_engine counts as the measured code: the bench files are the instrument
    status = ["git", "status", "--porcelain", "--untracked-files=no", "--", "rlhf_engine"]
    info["git_dirty"] = bool(subprocess.run(status, cwd=ROOT, capture_output=True, text=True).stdout.strip())
    return info


def command_line(argv: list) -> str:
    """The command that produced a result, without this checkout's absolute path (it reads the same anywhere)."""
    prefix = ROOT.rstrip("/") + "/"
    return " ".join(a.replace(prefix, "") for a in argv)


def script_command() -> str:
    return command_line([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])


def cell(text: Any) -> str:
    """Text safe inside a markdown table cell: one line, no '|'."""
    return str(text).strip().splitlines()[0].replace("|", "/") if str(text).strip() else ""


def read_json(path: str) -> Any:
    """The JSON at `path`, or None when it is missing or broken."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_jsonl(path: str) -> list:
    """One JSON value per non-empty line; [] when the file is missing."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except OSError:
        return []


def write_json(path: str, obj: Any) -> None:
    """Atomic write: a reader or a killed run never leaves half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)


def median(xs: list) -> Optional[float]:
    """The median of the values that are not None (None when there are none)."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x: Any, digits: int = 3) -> str:
    """A number for a table: 3 significant digits, thousands separated, no scientific notation."""
    if x is None:
        return "–"
    if isinstance(x, str):
        return x
    if isinstance(x, bool):
        return "yes" if x else "no"
    if x == 0:
        return "0"
    from math import floor, log10

    if abs(x) >= 10 ** digits:
        return f"{x:,.0f}"
    return f"{x:.{max(0, digits - 1 - floor(log10(abs(x))))}f}"
