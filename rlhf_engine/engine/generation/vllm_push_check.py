"""A weight push into the colocated vLLM engine that proves itself (docs/rollout-engines.md, "A push that proves
itself"): after every push, what the engine received is compared with the engine's own parameters, as vLLM names
them after its stacking of q/k/v and gate/up, and the run stops naming what is missing.

Why: vLLM's layerwise reload keeps a layer's old tensors when no weight reaches it and only logs a warning, and it
processes a fused layer that received only some of its parts (q without k and v) without a word. Either leaves the
engine sampling from a policy that is not the actor's, silently.

Two counts, both vLLM's own, both cheap (names and element counts, no data read), taken once per push:

* **Names.** The model's `load_weights` returns the names of the parameters it loaded (vLLM's names: `qkv_proj`,
  `gate_up_proj`); every name of the model's `named_parameters()` (a tied head is listed once, under the embedding)
  must be among them.
* **Elements.** During a reload vLLM counts, per layer, the elements its weight loaders copied against the layer's
  size, and processes a layer once the two meet; a layer still short when `load_weights` returns received only part
  of its weights. A vocabulary's padding rows (GPT-2's 50257 rows padded to 50304) are never loaded and do not count.

Also here: vLLM's loader warnings kept in the log when `quiet_vllm` raises vLLM's level to ERROR.
"""
from __future__ import annotations

import contextlib
import logging
import re
from collections import defaultdict
from typing import Any, Iterable, Iterator, Optional

from ...errors import TrainingStopped

log = logging.getLogger(__name__)

LOADER_LOGGER = "vllm.model_executor.model_loader"  # the weight loaders and the layerwise reload (reload/*.py)
_NO_WEIGHT = "%s: Failed to load weights"  # vLLM 0.32's layerwise reload, for a layer that received nothing
_BLOCK = re.compile(r"^(.*?\.\d+)\.")  # the first numbered module of a name: its decoder block


class WeightPushIncomplete(TrainingStopped):
    """A weight push left some of the engine's parameters without the actor's values: the engine would sample from
    another policy. Every rank streams the same weights, so every rank stops here together."""


def engine_parameter_names(model: Any) -> set:
    """The names of the engine model's parameters as vLLM names them (fused: `qkv_proj`, `gate_up_proj`); a
    parameter shared by two modules (a tied head) once, under its first name: what a full push must load."""
    return {name for name, _ in model.named_parameters()}


def block_of(name: str) -> str:
    """The decoder block a parameter belongs to (`model.layers.3`), or its module for one outside any block
    (`model.norm`)."""
    m = _BLOCK.match(name)
    return m.group(1) if m else name.rpartition(".")[0] or name


def vocab_padding(layer: Any) -> int:
    """Elements of a vocabulary layer (vLLM's VocabParallelEmbedding, ParallelLMHead) that no checkpoint fills: the
    rows padded on to its vocabulary (to a multiple of 64), times its width. 0 for any other layer."""
    idx, dim = getattr(layer, "shard_indices", None), getattr(layer, "embedding_dim", None)
    if idx is None or not isinstance(dim, int):
        return 0
    return max(0, idx.num_elements_padded - idx.num_org_elements - idx.num_added_elements) * dim


def short_layers(model: Any, owners: set) -> Optional[list]:
    """[(layer name, elements loaded, elements it takes)] for the layers among `owners` (those holding a parameter
    of their own) that vLLM's layerwise reload has not completed: read after the model's `load_weights` and before
    vLLM finalizes the reload (which resets the counts). None where this vLLM keeps no such counts."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:
        return None
    out = []
    for name, layer in model.named_modules():
        info = LAYERWISE_INFO.get(layer) if name in owners else None
        if info is None or not info.can_load():  # processed (all its elements arrived), or not reloaded
            continue
        need = int(info.load_numel_total or 0) - vocab_padding(layer)
        if info.load_numel < need:
            out.append((name, int(info.load_numel), need))
    return out


@contextlib.contextmanager
def recording_loads(model: Any, expected: set) -> Iterator[dict]:
    """While it is open, the model's `load_weights` (which vLLM's reload calls between starting and finalizing the
    reload) also records, in the dict it yields, what it returned ("loaded": vLLM's names) and the layers holding
    the `expected` parameters that are still short of elements at its return ("short": `short_layers`). Nothing is
    recorded if the reload never calls it."""
    record: dict = {}
    inner = model.__dict__.get("load_weights")
    load = model.load_weights
    owners = {name.rpartition(".")[0] for name in expected}

    def load_weights(weights: Iterable) -> Any:
        loaded = load(weights)
        record["loaded"] = None if loaded is None else set(loaded)
        record["short"] = short_layers(model, owners)
        return loaded

    model.__dict__["load_weights"] = load_weights  # an instance attribute: vLLM's `model.load_weights(...)` finds it
    try:
        yield record
    finally:
        if inner is None:
            model.__dict__.pop("load_weights", None)
        else:
            model.__dict__["load_weights"] = inner


def push_shortfall(expected: set, loaded: Optional[set], short: Optional[list]) -> list:
    """What a push left out, one line per block: the engine parameters (`expected`) that are not among the names the
    model loaded (`loaded`; None: not reported), and the layers that received only part of their elements
    (`short`: [(layer, loaded, needed)]; None: not counted; a layer whose parameters are named already is not
    repeated). Empty: the push reached every parameter."""
    by_block: dict = defaultdict(list)
    missing = sorted(expected - loaded) if loaded is not None else []
    for name in missing:
        by_block[block_of(name)].append(f"{name} (no weight)")
    named = {name.rpartition(".")[0] for name in missing}
    for layer, got, need in short or ():
        if layer not in named:
            by_block[block_of(layer + ".")].append(f"{layer} ({got} of {need} elements)")
    return [f"{block}: {', '.join(items)}" for block, items in sorted(by_block.items())]


def counted(weights: Iterable, tally: dict) -> Iterator:
    """`weights` ((name, tensor) pairs) passed through, their number and elements added to `tally` (metadata
    only)."""
    for name, tensor in weights:
        tally["tensors"] = tally.get("tensors", 0) + 1
        tally["elements"] = tally.get("elements", 0) + tensor.numel()
        yield name, tensor


_unchecked: list = []  # a push found uncheckable (warned once per process)


def check_push(record: dict, expected: set, tally: dict) -> None:
    """Raise `WeightPushIncomplete` naming the blocks and parameters a push left without a weight (`record`:
    `recording_loads`'s, `expected`: `engine_parameter_names` before the push, `tally`: `counted`'s)."""
    if "loaded" not in record:  # another vLLM whose reload skips the model's load_weights: nothing to compare
        if not _unchecked:
            log.warning("generation_backend vllm: this vLLM's reload does not go through the model's load_weights; "
                        "the weight pushes are not checked")
        _unchecked.append(True)
        return
    lines = push_shortfall(expected, record["loaded"], record["short"])
    if not lines:
        return
    raise WeightPushIncomplete(
        f"generation_backend vllm: the weight push ({tally.get('tensors', 0)} tensors, {tally.get('elements', 0)} "
        f"elements) did not reach every parameter of the engine, which keeps its old (or dummy) values there:\n  "
        + "\n  ".join(lines) + "\nLikely causes: names vLLM's loader for this architecture does not read (a MoE's "
        "fused experts, a renamed module), a block missing from the actor's stream, or a fused layer (q/k/v, "
        "gate/up) sent in parts")


# ---- vLLM's loader warnings, kept when quiet_vllm() raises vLLM's level to ERROR ----------------------------------
def loader_noise_classes(model: Any) -> set:
    """The layer classes whose 'Failed to load weights' warning is no news on every push: every such layer holds
    tensors but no parameter of its own (a rotary cache, an LM head tied to the embedding, an attention layer's
    scales), so no push can fill it."""
    owners = {name.rpartition(".")[0] for name in engine_parameter_names(model)}
    owns: dict = defaultdict(list)
    for name, layer in model.named_modules():
        if any(t is not None for t in (*layer._parameters.values(), *layer._buffers.values())):
            owns[type(layer).__name__].append(name in owners)
    return {cls for cls, flags in owns.items() if not any(flags)}


class LoaderWarnings(logging.Handler):
    """Hands the records of vLLM's weight loaders to this project's log, less the per-push warnings of layers that
    no push can fill (`noise`: class names, `loader_noise_classes`)."""

    def __init__(self, noise: Iterable = ()):
        super().__init__(logging.WARNING)
        self.noise = set(noise)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == _NO_WEIGHT and record.args and record.args[0] in self.noise:
            return False
        return super().filter(record)

    def emit(self, record: logging.LogRecord) -> None:
        log.handle(record)


def keep_loader_warnings(noise: Iterable = ()) -> LoaderWarnings:
    """vLLM's loader loggers at WARNING, into this project's log through one `LoaderWarnings` handler (added once;
    `noise` added to its filter). Call after the engine is built: vLLM reconfigures its loggers when an `LLM` is
    built (dictConfig resets every child of its 'vllm' logger)."""
    logger = logging.getLogger(LOADER_LOGGER)
    handler = next((h for h in logger.handlers if isinstance(h, LoaderWarnings)), None)
    if handler is None:
        handler = LoaderWarnings()
        logger.addHandler(handler)
    handler.noise |= set(noise)
    logger.setLevel(logging.WARNING)
    logger.propagate = False  # through vLLM's handler its errors would print twice; its warnings not at all
    return handler
