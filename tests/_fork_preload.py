"""What the forkserver of tests/_forked.py imports once, before it forks any rank: the modules every rank of a tiny
run imports (torch, DeepSpeed and its ZeRO optimizers, transformers' two tiny architectures, the package, the plot's
matplotlib). A fresh interpreter spends several CPU-seconds importing them; a forked rank finds them loaded. Imports
only: nothing here may start a thread or change a library's state (a rank must start as a fresh process would; the
server refuses to fork with a second thread or CUDA initialised, and what these imports set in the environment is
set in every rank, as in a fresh one after them: tests/_forked.py)."""
import sys

import numpy  # noqa: F401
import torch  # noqa: F401
import transformers  # noqa: F401
import transformers.models.gpt2.modeling_gpt2  # noqa: F401
import transformers.models.llama.modeling_llama  # noqa: F401
import deepspeed  # noqa: F401
import deepspeed.runtime.engine  # noqa: F401
import deepspeed.runtime.zero.stage3  # noqa: F401
import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401
import matplotlib.backends.backend_agg  # noqa: F401
import matplotlib.figure  # noqa: F401

import rlhf_engine.cli  # noqa: F401
import rlhf_engine.hooks  # noqa: F401
import rlhf_engine.trainer  # noqa: F401

sys.stdout.flush()
sys.stderr.flush()
# what the imports left is shared with every fork and out of every later collection's scan
rlhf_engine.cli.freeze_startup()
