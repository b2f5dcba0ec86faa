"""Run outputs: the metrics log, the run logger facade (wandb, TensorBoard, samples, plot), the output-dir policy."""
from .metrics import MetricsWriter, read_metrics
from .plot import PLOT_KEYS, plot_metrics
from .run_dir import RunDir, holds_run, prepare_output_dir, write_run_files
from .redact import redact, redact_argv
from .run_logger import RunLogger, wandb_mode

__all__ = ["MetricsWriter", "PLOT_KEYS", "RunDir", "RunLogger", "holds_run", "plot_metrics", "prepare_output_dir",
           "read_metrics", "redact", "redact_argv", "wandb_mode", "write_run_files"]
