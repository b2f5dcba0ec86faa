"""Run outputs: the metrics log."""
from .metrics import MetricsWriter, read_metrics

__all__ = ["MetricsWriter", "read_metrics"]
