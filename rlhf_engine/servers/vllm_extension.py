"""What a stock `vllm serve` loads for us (docs/rollout-servers.md): runs inside vLLM's worker processes only.

    --worker-extension-cls rlhf_engine.servers.vllm_extension.RolloutServerExtension
    --weight-transfer-config '{"backend": "rlhf_gloo"}'

* `GlooWeightTransfer`, registered as `rlhf_gloo` when vLLM imports this module (before the worker builds its
  weight-transfer engine): vLLM's weight-update lifecycle (`/init_weight_transfer_engine`, `/start_weight_update`,
  `/update_weights`, `/finish_weight_update`) over a gloo group of the trainer's rank 0 and this server's workers
  (it crosses hosts; vLLM's shipped backends are NCCL or CUDA IPC, none runs on a CPU). The trainer serves the
  group's TCP store; `init_info` names it. Each `/update_weights` call announces one block of tensors (Hugging Face
  names, dtypes, shapes) that the trainer then broadcasts in that order; each lands in a fresh tensor handed to the
  model's `load_weights` inside vLLM's layer-by-layer reload (`start` / `finish`), which stacks fused layers (q, k, v;
  gate, up) once all their parts arrived and packs the CPU kernels again. A tied LM head, which has no weight of its
  own to reload, is packed again after the finish (`repack_tied_head`).
* `RolloutServerExtension`: the worker methods the trainer calls through `/collective_rpc`: `rlhf_server_info`
  (architecture, longest sequence, dtype, extension version: the trainer's start-up check) and
  `rlhf_weight_receipt` (what the last update received: the trainer compares it with what it sent).

Nothing here is pickled or unpickled: the HTTP bodies are JSON, the weights raw tensor bytes.
"""
from __future__ import annotations

import datetime
import hashlib
from dataclasses import dataclass, field
from typing import Optional

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from .repack import repack_tied_head
from .protocol import BACKEND_NAME, EXTENSION_VERSION, STORE_PREFIX


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the trainer's group store listens and how big the group is (trainer = rank 0, this server's workers
    1 + their global rank)."""

    master_address: str = ""
    master_port: int = 0
    world_size: int = 2
    timeout_s: float = 300.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One block of weights, in the order the trainer broadcasts them."""

    names: list = field(default_factory=list)
    dtype_names: list = field(default_factory=list)  # torch dtype names: "float32", "bfloat16", ...
    shapes: list = field(default_factory=list)
    sha256: bool = False  # hash the received bytes (tests: bitwise equality with what the trainer sent)

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"update_info: {len(self.names)} names, {len(self.dtype_names)} dtypes and "
                             f"{len(self.shapes)} shapes")


class GlooWeightTransfer(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = self.store = None
        self.rank = 0
        self.receipt = _new_receipt()

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        from torch.distributed import PrefixStore, TCPStore
        from torch.distributed.distributed_c10d import ProcessGroupGloo

        pc = self.parallel_config
        self.rank = 1 + pc.data_parallel_index * pc.world_size + pc.rank
        timeout = datetime.timedelta(seconds=float(init_info.timeout_s))
        self.shutdown()
        self.store = TCPStore(init_info.master_address, int(init_info.master_port), int(init_info.world_size),
                              is_master=False, timeout=timeout)
        self.group = ProcessGroupGloo(PrefixStore(STORE_PREFIX, self.store), self.rank, int(init_info.world_size),
                                      timeout)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.receipt = _new_receipt()
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        # the base class ends with torch.accelerator.synchronize(), which raises on a CPU-only torch
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("rlhf_gloo: no weight group; call /init_weight_transfer_engine first")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        digest = hashlib.sha256() if update_info.sha256 else None
        with disable_mtp_completeness_check():
            for name, dtype, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
                # a fresh tensor for each: the layer-by-layer reload keeps a reference until its layer is complete
                t = torch.empty([int(s) for s in shape], dtype=getattr(torch, dtype))
                self.group.broadcast(t, 0).wait()
                if digest is not None:
                    digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
                self.model.load_weights([(name, t)])
                self.receipt["tensors"] += 1
                self.receipt["elements"] += t.numel()
        if digest is not None:
            self.receipt["sha256"].append(digest.hexdigest())

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        repack_tied_head(self.model)
        self.receipt["finished"] = True

    def shutdown(self) -> None:
        self.group = self.store = None


def _new_receipt() -> dict:
    return {"tensors": 0, "elements": 0, "sha256": [], "finished": False}


if BACKEND_NAME not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine(BACKEND_NAME, GlooWeightTransfer)


class RolloutServerExtension:
    """Mixed into vLLM's worker class (`--worker-extension-cls`): methods for `/collective_rpc`. Names carry the
    rlhf_ prefix: vLLM refuses an extension whose attribute the worker already has."""

    def rlhf_server_info(self) -> dict:
        mc = self.model_config
        engine = getattr(self, "weight_transfer_engine", None)
        return {"extension": EXTENSION_VERSION, "architectures": list(mc.architectures or []),
                "max_model_len": int(mc.max_model_len), "dtype": str(mc.dtype).replace("torch.", ""),
                "logprobs_mode": str(mc.logprobs_mode), "model": str(mc.model),
                "weight_transfer": type(engine).__name__ if engine is not None else None,
                # a trainer that died mid-push left an update open: the next trainer closes it before its own push
                "update_active": bool(getattr(self, "_weight_update_active", False))}

    def rlhf_weight_receipt(self) -> Optional[dict]:
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(engine.receipt) if isinstance(engine, GlooWeightTransfer) else None
