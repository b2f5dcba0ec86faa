"""metrics.jsonl: one flushed line per record, inapplicable keys omitted, never NaN."""
import math

import numpy as np
import pytest
import torch

from rlhf_engine.outputs import MetricsWriter, read_metrics


def test_write_and_read(tmp_path):
    out = tmp_path / "run" / "nested"
    w = MetricsWriter(str(out))
    w.write({"step": 1, "loss": torch.tensor(0.5), "kl": np.float32(0.25), "n": torch.tensor(3), "tag": "a",
             "skip": None, "nan": float("nan"), "inf": torch.tensor(math.inf), "np_nan": np.float64("nan"),
             "ok": True})
    # flushed before close: another process can read it while the run goes on
    assert read_metrics(str(out / "metrics.jsonl")) == [{"step": 1, "loss": 0.5, "kl": 0.25, "n": 3, "tag": "a",
                                                         "ok": True}]
    w.write({"step": 2, "loss": 0.25})
    w.close()
    with MetricsWriter(str(out)) as w2:  # appends to an existing file
        w2.write({"step": 3})
    recs = read_metrics(str(out))  # a folder works too
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert type(recs[0]["loss"]) is float and type(recs[0]["n"]) is int
    assert "NaN" not in (out / "metrics.jsonl").read_text()


def test_disabled_writes_nothing(tmp_path):
    MetricsWriter(str(tmp_path / "r"), enabled=False).write({"a": 1.0})
    assert not (tmp_path / "r").exists()


def test_rejects_non_scalars_and_nested_nan(tmp_path):
    w = MetricsWriter(str(tmp_path))
    with pytest.raises(TypeError, match="'v'"):
        w.write({"v": torch.ones(3)})
    with pytest.raises(ValueError):
        w.write({"hist": [1.0, float("nan")]})
    w.close()


def test_read_skips_a_torn_last_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"a": 1}\n{"b": 2}\n{"c": ')
    assert read_metrics(str(p)) == [{"a": 1}, {"b": 2}]
    p.write_text('{"a": 1}\n{"b": \n{"c": 3}\n')
    with pytest.raises(ValueError):
        read_metrics(str(p))
