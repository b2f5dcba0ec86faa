"""--reward_auth_token_env: a real PPO iteration (launch/train_ppo.py) scored by a reference server that requires a
bearer token. The requests carry the token and the rollout's ids; the token is in no file of the run directory, in
no log line and on no console, and the variable it sits in has a name the secrets redaction does not know (so only
never writing it keeps it out). Bad settings are one start-up error naming the flag."""
import logging
import os
import threading

import pytest

import launch.train_ppo as train_ppo
from rlhf_engine.cli import parse_args
from rlhf_engine.errors import ConfigError
from rlhf_engine.outputs.redact import secret_values
from rlhf_engine.rewards.serve import make_server

from _support import as_flags

TOKEN = "bearer-Xv93LqT0mZ7w2Ke"
VAR = "RM_BEARER_RUN"  # no KEY / TOKEN / SECRET / PASSWORD in the name: redact.py would not mask its value


class RecordingScorer:
    """Scores by response length and keeps what each request carried."""

    __rlhf_spec__ = "recording scorer"

    def __init__(self):
        self.bodies = []

    def score(self, body):
        self.bodies.append(body)
        return [float(len(r)) for r in body["responses"]]


def _files_containing(root, needle):
    hits = []
    for d, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(d, name), "rb") as f:
                if needle.encode() in f.read():
                    hits.append(os.path.relpath(os.path.join(d, name), root))
    return hits


def test_a_run_scored_by_an_authenticated_server_writes_its_token_nowhere(tiny, tmp_path, monkeypatch, capsys,
                                                                          caplog, dist_single):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv(VAR, TOKEN)
    assert TOKEN not in secret_values()
    scorer = RecordingScorer()
    server = make_server(scorer, auth_token=TOKEN)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    out = tmp_path / "run"
    try:
        rc = train_ppo.main(as_flags(dict(
            actor_model_name_or_path=tiny.actor, data_path=tiny.prompts, max_prompt_seq_len=64, max_answer_seq_len=8,
            output_dir=str(out), max_steps=1, per_device_generation_batch_size=2, per_device_training_batch_size=2,
            export_final="false", advantage_estimator="grpo", n_samples_per_prompt=2,
            reward_url=f"http://127.0.0.1:{server.server_port}/score", reward_auth_token_env=VAR)))
    finally:
        server.shutdown()
        server.server_close()
    console = capsys.readouterr()
    assert rc == 0, console.err
    assert len(scorer.bodies) >= 1  # only an authorised request reaches the scorer
    ro = scorer.bodies[0]["rollout"]  # the trainer sent the rollout's own ids
    assert len(ro["prompt_ids"]) == len(ro["response_ids"]) == len(scorer.bodies[0]["responses"])
    assert f'"reward_auth_token_env": "{VAR}"' in (out / "config.json").read_text()  # the name is kept
    n_files = sum(len(f) for _, _, f in os.walk(out))
    assert n_files > 5 and _files_containing(out, TOKEN) == []
    assert TOKEN not in console.out + console.err + caplog.text


@pytest.mark.parametrize("flags, message", [
    (dict(reward_url="http://127.0.0.1:1/", reward_auth_token_env="RM_UNSET_VAR_X"),
     "the environment variable RM_UNSET_VAR_X is not set or is empty"),
    (dict(reward_url="http://127.0.0.1:1/", reward_auth_token_env="RM_EMPTY_VAR_X"),
     "the environment variable RM_EMPTY_VAR_X is not set or is empty"),
    (dict(reward_auth_token_env=VAR), "set reward_url, or drop it"),
])
def test_a_token_variable_that_cannot_be_used_is_named(flags, message, monkeypatch):
    monkeypatch.setenv("RM_EMPTY_VAR_X", "  ")
    monkeypatch.setenv(VAR, TOKEN)
    monkeypatch.delenv("RM_UNSET_VAR_X", raising=False)
    with pytest.raises(ConfigError, match=rf"reward_auth_token_env = .*{message}") as e:
        parse_args(as_flags(dict(actor_model_name_or_path="/x", data_path="/x.jsonl", **flags)))
    assert TOKEN not in str(e.value)
