"""The bad-input catalogue of docs/faults.md ("Bad input: what you see"): one test per row not covered elsewhere.

Every case goes through launch/train_ppo.py's `main` in-process (one rank, the `dist_single` group) and checks what
the user sees: the exit code, one message naming the field / file / row and the fix, and that no file that existed
in the output directory changed (and, for problems found before any compute, that nothing was written at all).
"""
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil

import pytest

import launch.train_ppo as train_ppo


def flags(tiny, output_dir, **over):
    base = dict(actor_model_name_or_path=tiny.actor, reward_model_name_or_path=tiny.reward, data_path=tiny.prompts,
                max_prompt_seq_len=64, max_answer_seq_len=8, per_device_generation_batch_size=2,
                per_device_training_batch_size=2, max_steps=1, output_dir=str(output_dir))
    base.update(over)
    out = []
    for key, value in base.items():
        if value is None:
            continue
        out.append(f"--{key}")
        out += [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    return out


def tree(root) -> dict:
    """relative path -> (size, mtime_ns, sha256) of every file under root."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            path = os.path.join(d, f)
            st = os.stat(path)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns, hashlib.sha256(fh.read()).hexdigest())
    return out


@pytest.fixture
def out_dir(tmp_path):
    """An output folder that already holds a file of the user's (not a run): it must never change."""
    d = tmp_path / "run"
    d.mkdir()
    (d / "notes.txt").write_text("my notes\n")
    return d


def refused(capsys, out_dir, argv, code=2):
    """Run main(argv), expect `code` and nothing written to out_dir; return stderr."""
    before = tree(out_dir)
    try:
        rc = train_ppo.main(argv)
    except SystemExit as e:  # argparse errors exit from inside parse_args
        rc = e.code
    err = capsys.readouterr().err
    assert rc == code, err
    assert tree(out_dir) == before, "a refused run must not write or change anything in output_dir"
    return err


# ---- flags and config files -----------------------------------------------------------------------------------
def test_misspelt_flag(tiny, out_dir, capsys, dist_single):
    err = refused(capsys, out_dir, flags(tiny, out_dir) + ["--kl_coeff", "0.2", "--actor_lerning_rate", "1e-5"])
    assert "unrecognized arguments" in err
    assert '--kl_coeff (did you mean "kl_coef"?)' in err and '(did you mean "actor_learning_rate"?)' in err


def test_misspelt_config_file_key(tiny, out_dir, tmp_path, capsys, dist_single):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("kl_coef: 0.05\nactor_learnig_rate: 1.0e-5\n")
    err = refused(capsys, out_dir, flags(tiny, out_dir) + ["--config", str(cfg)])
    assert f"config file {cfg}: actor_learnig_rate = 1e-05: unknown key (did you mean \"actor_learning_rate\"?)" in err


def test_batch_sizes_that_do_not_divide(tiny, out_dir, capsys, dist_single):
    err = refused(capsys, out_dir, flags(tiny, out_dir, per_device_generation_batch_size=3,
                                         per_device_training_batch_size=2))
    assert "per_device_training_batch_size = 2" in err
    assert "per_device_generation_batch_size (3) x generation_batches (1) = 3 rollouts per rank" in err
    assert "e.g. set generation_batches to a multiple of 2" in err


# ---- models and tokenizers ------------------------------------------------------------------------------------
def _copy_without(src, dst, drop):
    shutil.copytree(src, dst)
    for name in os.listdir(dst):
        if any(name.startswith(d) for d in drop):
            os.remove(os.path.join(dst, name))
    return str(dst)


def test_missing_model_weights_tokenizer_and_folder_in_one_message(tiny, out_dir, tmp_path, capsys, dist_single):
    # an actor folder holding only config.json (no weights, no tokenizer files), a reward model that does not exist
    actor = _copy_without(tiny.actor, tmp_path / "actor_config_only", ("model", "tokenizer", "special", "vocab",
                                                                       "merges", "generation"))
    assert sorted(os.listdir(actor)) == ["config.json"]
    err = refused(capsys, out_dir, flags(tiny, out_dir, actor_model_name_or_path=actor,
                                         reward_model_name_or_path=str(tmp_path / "no_such_reward")))
    assert "cannot start: model setup (3 problems)" in err, err
    assert f"actor_model_name_or_path = '{actor}': holds no weights (none of model.safetensors" in err
    assert "give a complete Hugging Face model folder" in err
    assert f"actor_tokenizer_name_or_path = '{actor}': cannot load a tokenizer there" in err
    assert f"reward_model_name_or_path = '{tmp_path / 'no_such_reward'}': no such folder" in err


def test_missing_weight_shard(tiny, out_dir, tmp_path, capsys, dist_single):
    actor = _copy_without(tiny.actor, tmp_path / "sharded", ("model",))
    with open(os.path.join(actor, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                  "b": "model-00002-of-00002.safetensors"}}, f)
    shutil.copy(os.path.join(tiny.actor, "model.safetensors"), os.path.join(actor, "model-00001-of-00002.safetensors"))
    err = refused(capsys, out_dir, flags(tiny, out_dir, actor_model_name_or_path=actor))
    assert ("model.safetensors.index.json names 1 weight shard(s) that are not in the folder "
            "(model-00002-of-00002.safetensors); copy the complete model folder") in err


def _tokenizer_without(tiny, dst, *names):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny.tokenizer)
    for name in names:
        setattr(tok, name, None)
    tok.save_pretrained(str(dst))
    check = AutoTokenizer.from_pretrained(str(dst))
    assert all(getattr(check, n) is None for n in names)
    return str(dst)


def test_tokenizer_without_eos_token(tiny, out_dir, tmp_path, capsys, dist_single):
    tok = _tokenizer_without(tiny, tmp_path / "tok_no_eos", "pad_token", "eos_token")
    err = refused(capsys, out_dir, flags(tiny, out_dir, actor_tokenizer_name_or_path=tok))
    assert f"actor_tokenizer_name_or_path = '{tok}': the tokenizer has no EOS token" in err
    assert "give a tokenizer with one" in err


def test_tokenizer_without_pad_token_uses_eos_and_says_so(tiny, tmp_path, capsys, caplog, dist_single):
    """The policy: no pad token -> EOS is the pad token (logged once per load); the run goes on."""
    tok = _tokenizer_without(tiny, tmp_path / "tok_no_pad", "pad_token")
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        rc = train_ppo.main(flags(tiny, out, actor_tokenizer_name_or_path=tok))
    assert rc == 0, capsys.readouterr().err
    assert "tokenizer has no pad token: using EOS" in caplog.text
    assert len(open(out / "metrics.jsonl").readlines()) == 1


_HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(_HAS_VLLM, reason="vLLM is installed in this environment")
def test_vllm_backend_without_vllm_names_the_extra(tiny, out_dir, capsys, dist_single):
    err = refused(capsys, out_dir, flags(tiny, out_dir, generation_backend="vllm"))
    assert "generation_backend = 'vllm': vLLM is not installed in this environment" in err, err
    assert "pip install -e '.[vllm]'" in err and "bash scripts/install.sh --vllm" in err


def test_a_tensor_parallel_engine_for_another_backend_is_refused(tiny, out_dir, capsys, dist_single):
    """--vllm_tensor_parallel_size applies to the colocated vllm engine: with lean it would change nothing, silently.
    (Its other refusals, engine/generation/vllm_tp.tp_problems: tests/unit/engine/test_vllm_tp.py.)"""
    err = refused(capsys, out_dir, flags(tiny, out_dir, generation_backend="lean", vllm_tensor_parallel_size=2))
    assert "vllm_tensor_parallel_size = 2: applies to generation_backend vllm (this run generates with lean)" in err


@pytest.mark.vllm
@pytest.mark.skipif(not _HAS_VLLM, reason="vLLM is not installed here (bash scripts/install.sh --vllm)")
def test_vllm_refuses_a_model_it_cannot_run_before_any_engine(tiny, out_dir, tmp_path, capsys, dist_single):
    """The tiny GPT-2 has head size 16 (vLLM's CPU attention refuses it), and an architecture vLLM lacks."""
    actor = shutil.copytree(tiny.actor, tmp_path / "unknown_arch")
    with open(os.path.join(actor, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = ["NoSuchModelForCausalLM"]
    with open(os.path.join(actor, "config.json"), "w") as f:
        json.dump(config, f)
    err = refused(capsys, out_dir, flags(tiny, out_dir, generation_backend="vllm"))
    assert "generation_backend = 'vllm': the actor's head size is 16 and vLLM's CPU attention takes only 32" in err
    err = refused(capsys, out_dir, flags(tiny, out_dir, generation_backend="vllm", actor_model_name_or_path=actor))
    assert "has no implementation of the actor's architecture ['NoSuchModelForCausalLM']" in err, err


# ---- data -----------------------------------------------------------------------------------------------------
def test_missing_data_file_and_column(tiny, out_dir, tmp_path, capsys, dist_single):
    err = refused(capsys, out_dir, flags(tiny, out_dir, data_path=str(tmp_path / "nope.jsonl")))
    assert "data_path" in err and "nope.jsonl" in err and "does not exist" in err
    wrong = tmp_path / "questions.jsonl"
    wrong.write_text("".join(json.dumps({"question": f"q {i}", "id": i}) + "\n" for i in range(8)))
    err = refused(capsys, out_dir, flags(tiny, out_dir, data_path=str(wrong)))
    assert "prompt_column = 'prompt'" in err and str(wrong) in err, err
    assert "'question'" in err and "'id'" in err  # the columns the file does have
    # a hub name while offline that the local datasets cache does not hold; a folder save_to_disk did not write
    err = refused(capsys, out_dir, flags(tiny, out_dir, data_path="someorg/not_downloaded"))
    assert "data_path = 'someorg/not_downloaded'" in err and "not in the Hugging Face datasets cache" in err
    (tmp_path / "a_folder").mkdir()
    err = refused(capsys, out_dir, flags(tiny, out_dir, data_path=str(tmp_path / "a_folder")))
    assert "not one written by datasets' save_to_disk" in err


def _bad_rows_file(tiny, path):
    good = [json.loads(line) for line in open(tiny.prompts)]
    lines = [json.dumps(r).encode() for r in good[:10]]
    lines[2] = json.dumps({"prompt": ""}).encode()  # empty
    lines[4] = b'{"prompt": "caf\xe9 au lait"}'  # latin-1 bytes: not UTF-8
    lines[6] = json.dumps({"prompt": None}).encode()  # null
    lines[8] = b'{"prompt": "no closing brace"'  # not JSON
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def test_empty_rows_and_non_utf8_bytes_are_named(tiny, out_dir, tmp_path, capsys, dist_single):
    data = _bad_rows_file(tiny, tmp_path / "bad.jsonl")
    err = refused(capsys, out_dir, flags(tiny, out_dir, data_path=data))
    assert "data_path" in err and data in err
    for row in ("2", "4", "6", "8"):
        assert row in err
    assert "UTF-8" in err and "bad_row_policy" in err, err


def test_bad_rows_skipped_and_counted_with_the_skip_policy(tiny, tmp_path, capsys, caplog, dist_single):
    data = _bad_rows_file(tiny, tmp_path / "bad.jsonl")
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO):
        rc = train_ppo.main(flags(tiny, out, data_path=data, bad_row_policy="skip"))
    assert rc == 0, capsys.readouterr().err
    summary = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage() and "rows" in r.getMessage()]
    assert summary and "1 invalid UTF-8" in summary[0] and "1 invalid JSON" in summary[0], caplog.text
    assert "2 empty" in summary[0], summary


# ---- reward function ------------------------------------------------------------------------------------------
def test_a_reward_function_that_raises_stops_the_run_naming_it(tiny, tmp_path, capsys, monkeypatch, dist_single):
    (tmp_path / "my_rewards.py").write_text("def boom(prompts, responses):\n    raise KeyError('lookup table')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    rc = train_ppo.main(flags(tiny, out, reward_fn="my_rewards:boom", reward_model_name_or_path=None))
    err = capsys.readouterr().err
    assert rc == 1, err
    line = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(line) == 1, err
    assert re.match(r"error: rank 0(, iteration 0)?: reward function my_rewards:boom raised KeyError: 'lookup table'",
                    line[0]), line
    assert "fix the function: it is called as fn(prompts, responses)" in line[0]
    assert not (out / "checkpoints").exists()  # nothing of the failed iteration was saved


# ---- checkpoints ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_checkpoints(tiny, tmp_path_factory, dist_single):
    """A finished 1-rank run with complete checkpoints iter_000001 and iter_000002."""
    out = tmp_path_factory.mktemp("ckpt") / "run"
    rc = train_ppo.main(flags(tiny, out, max_steps=2, save_interval=1, keep_last=0, export_final="false"))
    assert rc == 0
    return out


@pytest.fixture
def run_copy(two_checkpoints, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(two_checkpoints, dst)
    return dst


def test_corrupt_checkpoint_is_refused_or_skipped_and_named(tiny, run_copy, capsys, caplog, dist_single):
    ckpt2 = run_copy / "checkpoints" / "iter_000002"
    shard = ckpt2 / "actor" / "mp_rank_00_model_states.pt"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)  # a copy cut short / a full disk
    # an explicit path: refused before anything is loaded or moved
    err = refused(capsys, run_copy, flags(tiny, run_copy, max_steps=3, save_interval=1, keep_last=0,
                                          resume=str(ckpt2)))
    assert f"resume = '{ckpt2}': the checkpoint is corrupt: actor/mp_rank_00_model_states.pt has {size // 2} bytes, " \
           f"the marker says {size}" in err, err
    assert "resume from an earlier one" in err and "complete ones there: iter_000001, iter_000002" in err
    # --resume auto: skips it, says so, continues from iter_000001; the corrupt folder is kept aside, not deleted
    before = {k: v for k, v in tree(run_copy).items() if k.startswith("checkpoints/iter_000001")}
    with caplog.at_level(logging.INFO):
        rc = train_ppo.main(flags(tiny, run_copy, max_steps=3, save_interval=1, keep_last=0, resume="auto"))
    assert rc == 0, capsys.readouterr().err
    assert ("resuming from " + str(run_copy / "checkpoints" / "iter_000001") + " (iteration 1), the newest complete "
            "checkpoint (skipped corrupt: iter_000002: actor/mp_rank_00_model_states.pt has") in caplog.text
    names = sorted(os.listdir(run_copy / "checkpoints"))
    assert names[:2] == ["iter_000001", "iter_000002"] and names[2].startswith("iter_000002.abandoned-")
    assert names[3] == "iter_000003" and len(names) == 4
    assert {k: v for k, v in tree(run_copy).items() if k.startswith("checkpoints/iter_000001")} == before


def test_unreadable_state_file_is_named(tiny, run_copy, capsys, dist_single):
    ckpt1 = run_copy / "checkpoints" / "iter_000001"
    state = ckpt1 / "state_rank0.pt"
    state.write_bytes(b"\0" * state.stat().st_size)  # same size, other bytes: only reading it can tell
    err = refused(capsys, run_copy, flags(tiny, run_copy, max_steps=3, resume=str(ckpt1)))
    assert f"resume = '{ckpt1}': state_rank0.pt cannot be read" in err and "the checkpoint is corrupt" in err, err


def test_resume_with_another_global_batch_is_refused(tiny, run_copy, capsys, dist_single):
    marker = run_copy / "checkpoints" / "iter_000002" / "COMPLETE"
    meta = json.loads(marker.read_text())
    fp = meta["fingerprint"]
    meta["world_size"] = 2  # as if written by a 2-rank run with the same per-device sizes: twice the global batch
    g = fp["global_generation_batch_size"]
    fp.update(global_generation_batch_size=2 * g, global_mini_batch_size=2 * fp["global_mini_batch_size"])
    marker.write_text(json.dumps(meta))
    err = refused(capsys, run_copy, flags(tiny, run_copy, max_steps=3, save_interval=1, keep_last=0, resume="auto"))
    assert f"global_generation_batch_size = {g}: the checkpoint's run had global_generation_batch_size = {2 * g}" \
        in err and "global_mini_batch_size" in err
    assert "pass --resume_force to resume anyway" in err
