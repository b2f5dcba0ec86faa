"""Checkpoint folders on disk: the completion marker, discovery (--resume auto / a path), rotation, the refusal of
another run's checkpoint, and the run files trimmed on resume. No engines: folders are made by hand."""
import json
import logging
import os

import pytest

from rlhf_engine.errors import ConfigError
from rlhf_engine.outputs import checkpoint as ck


def make(root, iteration, complete=True, **meta):
    path = os.path.join(root, ck.tag_for(iteration))
    os.makedirs(os.path.join(path, "actor"), exist_ok=True)
    with open(os.path.join(path, "state_rank0.pt"), "wb") as f:
        f.write(b"x")
    if complete:
        ck.write_marker(path, {"iteration": iteration, **meta})
    return path


def test_tags_and_marker(tmp_path):
    assert ck.tag_for(4) == "iter_000004" and ck.tag_for(1234567) == "iter_1234567"
    assert ck.iteration_of("iter_000004") == 4 and ck.iteration_of("/a/b/iter_000012/") == 12
    for other in ("iter_4", "iter_000004.replaced-20260101-000000", "global_step4", "latest"):
        assert ck.iteration_of(other) is None, other
    with pytest.raises(ValueError):
        ck.tag_for(-1)
    path = make(str(tmp_path), 4, fingerprint={"seed": 1})
    meta = ck.read_marker(path)
    assert meta["format"] == ck.MARKER_FORMAT and meta["iteration"] == 4 and meta["fingerprint"] == {"seed": 1}
    assert not os.path.exists(os.path.join(path, "COMPLETE.tmp"))  # written atomically
    # a marker that is not valid JSON (a write cut short on a filesystem without atomic rename) is no marker
    with open(os.path.join(path, "COMPLETE"), "w") as f:
        f.write('{"iteration": 4')
    assert ck.read_marker(path) is None and not ck.is_complete(path)


def test_listing_ignores_unmarked_and_foreign_folders(tmp_path):
    root = str(tmp_path)
    make(root, 2)
    make(root, 4)
    make(root, 6, complete=False)
    os.makedirs(os.path.join(root, "iter_000008.abandoned-20260101-000000"))
    ck.write_marker(os.path.join(root, "iter_000008.abandoned-20260101-000000"), {"iteration": 8})
    open(os.path.join(root, "iter_000010"), "w").close()  # a file, not a folder
    complete, incomplete = ck.list_checkpoints(root)
    assert [i for i, _ in complete] == [2, 4] and [i for i, _ in incomplete] == [6]
    assert ck.latest_complete(root).endswith("iter_000004")
    assert ck.list_checkpoints(os.path.join(root, "missing")) == ([], [])


def test_resume_auto_picks_the_newest_marked_and_says_so(tmp_path):
    out = str(tmp_path)
    root = ck.checkpoints_root(out)
    path, why = ck.resolve_resume("auto", out)
    assert path is None and "no complete checkpoint" in why and "starting at iteration 0" in why
    make(root, 4)
    make(root, 8)
    make(root, 12, complete=False)
    path, why = ck.resolve_resume("auto", out)
    assert path == os.path.join(root, "iter_000008")
    assert why == (f"--resume auto: resuming from {path} (iteration 8), the newest complete checkpoint (skipped "
                   "incomplete, no COMPLETE marker: iter_000012)")
    assert ck.resolve_resume("", out) == (None, "no resume requested")


def test_resume_from_a_path(tmp_path):
    out = str(tmp_path / "run")
    root = ck.checkpoints_root(out)
    make(root, 4)
    bad = make(root, 6, complete=False)
    # a checkpoint folder with its marker
    assert ck.resolve_resume(os.path.join(root, "iter_000004"), "elsewhere")[0] == os.path.join(root, "iter_000004")
    # a run folder, or its checkpoints folder: the newest complete checkpoint there
    assert ck.resolve_resume(out, "elsewhere")[0] == os.path.join(root, "iter_000004")
    assert ck.resolve_resume(root, "elsewhere")[0] == os.path.join(root, "iter_000004")
    # never a folder without the marker
    with pytest.raises(ConfigError) as e:
        ck.resolve_resume(bad, out)
    assert "no COMPLETE marker" in str(e.value) and "complete ones there: iter_000004" in str(e.value)
    for missing in (str(tmp_path / "nope"), str(tmp_path)):
        with pytest.raises(ConfigError) as e:
            ck.resolve_resume(missing, out)
        assert e.value.problems[0].field == "resume"


def test_rotation_keeps_the_newest_k_marked_and_never_touches_unmarked(tmp_path):
    root = str(tmp_path)
    for it in (2, 4, 6, 8):
        make(root, it)
    make(root, 3, complete=False)
    make(root, 10, complete=False)  # a save in progress (or cut short): never counted, never deleted
    assert ck.rotate(root, 0) == []  # keep all
    deleted = ck.rotate(root, 2)
    assert [os.path.basename(p) for p in deleted] == ["iter_000002", "iter_000004"]
    assert sorted(os.listdir(root)) == ["iter_000003", "iter_000006", "iter_000008", "iter_000010"]
    assert ck.rotate(root, 2) == []


def test_prepare_tag_dir_and_abandon_newer(tmp_path, caplog):
    root = str(tmp_path)
    debris = make(root, 6, complete=False)
    assert ck.prepare_tag_dir(root, "iter_000006") == debris and os.listdir(debris) == []  # debris removed
    make(root, 8)
    with caplog.at_level(logging.WARNING):
        ck.prepare_tag_dir(root, "iter_000008")  # a complete one of an older timeline: moved aside, not overwritten
    assert any(n.startswith("iter_000008.replaced-") for n in os.listdir(root))
    make(root, 4)
    make(root, 12)
    make(root, 16)
    moved = ck.abandon_newer(root, 4)
    assert [os.path.basename(m).split(".")[0] for m in moved] == ["iter_000012", "iter_000016"]
    assert ck.latest_complete(root).endswith("iter_000004")


def test_fingerprint_refusal_names_every_differing_key(caplog):
    saved = {"world_size": 2, "seed": 1, "actor_model_name_or_path": "/m/a", "generation_batches": 2,
             "stop": [1, 2], "only_saved": 1}
    now = {"world_size": 4, "seed": 1, "actor_model_name_or_path": "/m/b", "generation_batches": 2,
           "stop": (1, 2), "only_now": 2}
    assert ck.diff_fingerprints(saved, saved) == []
    diffs = ck.diff_fingerprints(saved, now)
    assert [k for k, _, _ in diffs] == ["actor_model_name_or_path", "only_now", "only_saved", "world_size"]
    with pytest.raises(ConfigError) as e:
        ck.check_fingerprint(saved, now, "/run/checkpoints/iter_000004")
    err = e.value
    assert [p.field for p in err.problems] == ["actor_model_name_or_path", "only_now", "only_saved", "world_size"]
    assert err.problems[-1].value == 4 and "world_size = 2" in err.problems[-1].fix
    assert "--resume_force" in str(err) and "/run/checkpoints/iter_000004" in str(err) and "4 keys" in str(err)
    with caplog.at_level(logging.WARNING):
        assert len(ck.check_fingerprint(saved, now, "/x", force=True)) == 4
    assert "--resume_force" in caplog.text and "world_size" in caplog.text


def test_trim_after_resume_keeps_earlier_iterations_and_backs_up_the_rest(tmp_path):
    out = str(tmp_path)
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        for it in range(6):
            f.write(json.dumps({"iteration": it, "x": it}) + "\n")
        f.write('{"iteration": 6, "x"')  # cut short by the crash
    with open(os.path.join(out, "samples.jsonl"), "w") as f:
        f.write(json.dumps({"iteration": 1, "prompt": "p"}) + "\n")
    backups = ck.trim_after_resume(out, 4)
    assert len(backups) == 1 and backups[0].startswith(os.path.join(out, "metrics.jsonl.dropped-"))
    kept = [json.loads(ln)["iteration"] for ln in open(os.path.join(out, "metrics.jsonl"))]
    assert kept == [0, 1, 2, 3]
    assert len(open(backups[0]).read().splitlines()) == 3
    assert open(os.path.join(out, "samples.jsonl")).read().count("\n") == 1  # nothing to drop: untouched
    assert ck.trim_after_resume(out, 0)[0].startswith(os.path.join(out, "metrics.jsonl.dropped-"))
    assert open(os.path.join(out, "metrics.jsonl")).read() == ""


def _sized(root, iteration):
    """A complete checkpoint whose marker records its file sizes (as Checkpointer.save writes it)."""
    path = make(root, iteration, complete=False)
    with open(os.path.join(path, "actor", "model_states.pt"), "wb") as f:
        f.write(b"w" * 100)
    ck.write_marker(path, {"iteration": iteration, "files": ck.file_sizes(path)})
    return path


def test_marker_sizes_detect_a_truncated_or_missing_file(tmp_path):
    out = str(tmp_path)
    root = ck.checkpoints_root(out)
    p4, p8 = _sized(root, 4), _sized(root, 8)
    assert ck.read_marker(p8)["files"] == {"actor/model_states.pt": 100, "state_rank0.pt": 1}
    assert ck.corrupt_files(p8) == []
    assert ck.corrupt_files(make(root, 2)) == []  # a marker without sizes (older format): not checked
    with open(os.path.join(p8, "actor", "model_states.pt"), "r+b") as f:
        f.truncate(40)
    os.remove(os.path.join(p8, "state_rank0.pt"))
    assert ck.corrupt_files(p8) == ["actor/model_states.pt has 40 bytes, the marker says 100",
                                    "state_rank0.pt is missing"]
    # auto skips it and says so; a run folder too
    for spec in ("auto", out):
        path, why = ck.resolve_resume(spec, out)
        assert path == p4, why
        assert why.endswith("(skipped corrupt: iter_000008: actor/model_states.pt has 40 bytes, the marker says 100 "
                            "(+1 more))"), why
    # an explicit path is refused, naming the file and the complete ones there
    with pytest.raises(ConfigError) as e:
        ck.resolve_resume(p8, out)
    assert "the checkpoint is corrupt: actor/model_states.pt has 40 bytes" in str(e.value)
    assert "complete ones there: iter_000002, iter_000004, iter_000008" in str(e.value)
    # every complete one corrupt: refused (never a silent restart at iteration 0)
    for p in (p4, os.path.join(root, "iter_000002")):
        os.remove(os.path.join(p, "state_rank0.pt"))
    ck.write_marker(os.path.join(root, "iter_000002"), {"iteration": 2, "files": {"state_rank0.pt": 1}})
    with pytest.raises(ConfigError, match="every complete checkpoint is corrupt"):
        ck.resolve_resume("auto", out)
