"""No secret anywhere in a real run directory: a tiny PPO run (one iteration, a checkpoint, the export, wandb offline)
with WANDB_API_KEY and another secret in the environment, and a secret on the command line."""
import os

from _trainer_args import train_args

import launch.train_ppo as train_ppo

WANDB_KEY = "wbkey-5f3c9a0e1d2b4c6a8e7f9012345678abcdef0123"
SERVICE_TOKEN = "svc-tok-Zq8wX1vY2uT3sR4p"


def _files_containing(root, needles):
    hits = []
    for d, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(d, name), "rb") as f:
                data = f.read()
            hits += [(os.path.relpath(os.path.join(d, name), root), n) for n in needles if n.encode() in data]
    return hits


def test_no_secret_in_any_file_of_the_run_directory(tiny, tmp_path, monkeypatch, capsys, dist_single):
    monkeypatch.setenv("WANDB_API_KEY", WANDB_KEY)
    monkeypatch.setenv("MY_SERVICE_TOKEN", SERVICE_TOKEN)
    monkeypatch.setenv("WANDB_MODE", "offline")  # never the network, key or not
    monkeypatch.delenv("WANDB_DISABLED", raising=False)
    for var in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "run"
    argv = train_args(tiny, str(out), max_steps=1, per_device_generation_batch_size=2,
                      per_device_training_batch_size=2, save_interval=1, wandb_project="x",
                      wandb_run_name=f"run-{SERVICE_TOKEN}")  # a secret on the command line too
    rc = train_ppo.main(argv)
    assert rc == 0, capsys.readouterr().err
    names = set(os.listdir(out))
    assert {"metrics.jsonl", "samples.jsonl", "config.json", "command.txt", "checkpoints", "final", "wandb"} <= names
    runs = [d for d in os.listdir(out / "wandb") if d.startswith("offline-run-")]
    assert len(runs) == 1 and os.listdir(out / "wandb" / runs[0]), "the offline wandb run must be in the run dir"
    assert os.path.isfile(out / "checkpoints" / "iter_000001" / "COMPLETE")
    n_files = sum(len(f) for _, _, f in os.walk(out))
    assert n_files > 20  # logs, configs, metrics, samples, wandb files, checkpoint shards, exported weights
    assert _files_containing(out, [WANDB_KEY, SERVICE_TOKEN]) == []
    # the redaction is visible, not a silent drop: the command line keeps the flag with its value masked
    assert "--wandb_run_name 'run-***'" in (out / "command.txt").read_text()
