"""SLURM's environment mapped to torch.distributed's (no SLURM needed: the environments are faked), the hostfile
generator, and the sbatch scripts (dry run; on SIGUSR1 the signal goes to the ranks, never the launcher, and the job
is requeued only when the run left a PREEMPTED marker, with fake `deepspeed` and `scontrol`)."""
import os
import signal
import subprocess
import sys
import time

import pytest

from rlhf_engine.engine.distributed import (env_from_slurm, expand_nodelist, launch_env, parse_tasks_per_node,
                                            slurm_port)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SLURM_DIR = os.path.join(ROOT, "launch", "slurm")


def srun_task(procid, localid, nodeid, ntasks, nodelist, per_node, job="4242"):
    """The variables srun gives one task of a job step (plus the batch job's)."""
    return {"SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": nodelist, "SLURM_NNODES": str(len(per_node)),
            "SLURM_NTASKS": str(ntasks), "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": str(ntasks),
            "SLURM_STEP_NODELIST": nodelist, "SLURM_STEP_TASKS_PER_NODE": per_node_spec(per_node),
            "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid)}


def per_node_spec(per_node):
    return f"{per_node[0]}(x{len(per_node)})" if len(set(per_node)) == 1 else ",".join(map(str, per_node))


def test_nodelists():
    assert expand_nodelist("node[01-03,07]") == ["node01", "node02", "node03", "node07"]
    assert expand_nodelist("gpu-a[9-11],cpu7") == ["gpu-a9", "gpu-a10", "gpu-a11", "cpu7"]
    assert expand_nodelist("rack[1-2]-n[01-02]") == ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]
    assert expand_nodelist("single") == ["single"]
    assert expand_nodelist("a1,b[008-010]x") == ["a1", "b008x", "b009x", "b010x"]
    assert parse_tasks_per_node("4(x2),3") == [4, 4, 3] and parse_tasks_per_node("8") == [8]


def test_port_from_the_job_id():
    assert slurm_port("123456") == 15000 + 123456 % 10000 == 18456
    assert slurm_port("123456") == slurm_port("123456")  # every task (and a requeued job) agrees
    assert 15000 <= slurm_port("abc") < 25000


def test_one_node_two_tasks():
    envs = [srun_task(r, r, 0, 2, "node07", [2]) for r in range(2)]
    got = [env_from_slurm(e) for e in envs]
    for r, g in enumerate(got):
        assert g == {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "NODE_RANK": "0", "LOCAL_SIZE": "2",
                     "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node07", "MASTER_PORT": str(15000 + 4242)}


def test_two_nodes_four_tasks():
    got = [env_from_slurm(srun_task(r, r % 2, r // 2, 4, "gpu[07-08]", [2, 2], job="98765")) for r in range(4)]
    assert [(g["RANK"], g["LOCAL_RANK"], g["NODE_RANK"]) for g in got] == [("0", "0", "0"), ("1", "1", "0"),
                                                                         ("2", "0", "1"), ("3", "1", "1")]
    assert {g["WORLD_SIZE"] for g in got} == {"4"} and {g["MASTER_ADDR"] for g in got} == {"gpu07"}
    assert {g["MASTER_PORT"] for g in got} == {str(15000 + 98765 % 10000)}
    # uneven tasks per node: this node's count
    g = env_from_slurm(srun_task(4, 0, 1, 5, "n[1-2]", [4, 1]))
    assert g["LOCAL_SIZE"] == "1" and g["MASTER_ADDR"] == "n1"


def test_given_addresses_win_and_the_batch_script_is_not_a_task():
    env = {**srun_task(1, 1, 0, 2, "node[01-02]", [2]), "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29999"}
    got = env_from_slurm(env)
    assert (got["MASTER_ADDR"], got["MASTER_PORT"]) == ("10.0.0.5", "29999")
    # the batch script itself (no job step): SLURM_PROCID=0 and the allocation's SLURM_NTASKS, but no srun tasks
    batch = {k: v for k, v in srun_task(0, 0, 0, 8, "node[01-02]", [4, 4]).items() if not k.startswith("SLURM_STEP")}
    assert env_from_slurm(batch) == {}
    assert env_from_slurm({}) == {}


def test_launcher_variables_win_over_slurm():
    slurm = srun_task(1, 1, 0, 2, "node01", [2])
    assert launch_env({**slurm, "RANK": "0", "WORLD_SIZE": "8"}) == {}  # deepspeed launcher / torchrun inside SLURM
    assert launch_env(slurm)["RANK"] == "1"
    single = launch_env({})
    assert (single["RANK"], single["WORLD_SIZE"], single["MASTER_ADDR"]) == ("0", "1", "127.0.0.1")


def test_hostfile(tmp_path):
    out = tmp_path / "hostfile"
    env = {**os.environ, "SLURM_JOB_NODELIST": "gpu[07-08],big01", "SLURM_GPUS_PER_NODE": "h100:4"}
    proc = subprocess.run([sys.executable, os.path.join(SLURM_DIR, "hostfile.py"), "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "gpu07"
    assert out.read_text() == "gpu07 slots=4\ngpu08 slots=4\nbig01 slots=4\n"


def _sbatch_env(tmp_path, **extra):
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "SLURM_JOB_ID": "123456",
           "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_GPUS_ON_NODE": "4",
           "SLURM_CPUS_PER_TASK": "32", "SLURM_SUBMIT_DIR": ROOT, "OUTPUT_DIR": str(tmp_path / "run"),
           "RLHF_VENV": "none", "PYTHON": sys.executable}
    env.update(extra)
    return env


@pytest.mark.parametrize("script, expected", [
    ("ppo_single_node.sbatch", "OMP_NUM_THREADS=8 deepspeed --num_gpus 4 --master_port 18456 launch/train_ppo.py"),
    ("ppo_multi_node_deepspeed.sbatch", "OMP_NUM_THREADS=8 deepspeed --hostfile {out}/hostfile.123456 --num_nodes 2 "
     "--num_gpus 4 --master_addr gpu07 --master_port 18456 --launcher pdsh launch/train_ppo.py"),
    ("ppo_multi_node_srun.sbatch", "OMP_NUM_THREADS=32 srun --kill-on-bad-exit=1 --gpu-bind=none {py} -u "
     "launch/train_ppo.py"),
])
def test_sbatch_scripts_dry_run(tmp_path, script, expected):
    env = _sbatch_env(tmp_path, RLHF_DRY_RUN="1")
    proc = subprocess.run(["bash", os.path.join(SLURM_DIR, script), "--max_steps", "5"], env=env, cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip().splitlines()[-1]
    want = ("DRY RUN: " + expected.format(out=env["OUTPUT_DIR"], py=sys.executable)
            + f" --output_dir {env['OUTPUT_DIR']} --resume auto --save_interval_minutes 30 --max_steps 5")
    assert line == want, (line, want)
    if "hostfile" in expected:
        assert open(os.path.join(env["OUTPUT_DIR"], "hostfile.123456")).read() == "gpu07 slots=4\ngpu08 slots=4\n"


# A fake deepspeed launcher: it starts one fake rank (LOCAL_RANK in its environment, as real launchers set) and
# records any SIGUSR1 it gets itself (a real launcher would die of it, and kill its ranks). The rank answers SIGUSR1
# like the trainer: with the PREEMPTED marker and exit 75, or (MARK=0: its last iteration) exit 0 and no marker.
FAKE_LAUNCHER = """#!/bin/bash
echo "deepspeed $*" >> {log}
LOCAL_RANK=0 bash -c 'trap "echo rank USR1 >> {log}; [ $MARK = 1 ] && echo {{}} > $OUTPUT_DIR/PREEMPTED && exit 75; \
exit 0" USR1; while true; do sleep 0.05; done' &
rank=$!
trap 'echo launcher USR1 >> {log}' USR1
while kill -0 $rank 2>/dev/null; do wait $rank; rc=$?; done
exit $rc
"""


@pytest.mark.parametrize("mark, rc, requeued", [("1", 75, True), ("0", 0, False)])
def test_sbatch_signals_the_ranks_and_requeues_only_a_preempted_run(tmp_path, mark, rc, requeued):
    """SIGUSR1 to the batch shell (#SBATCH --signal=B:USR1@300) -> SIGUSR1 to the rank processes (not the
    launcher), the request file for ranks no signal reaches; after the launcher exits, `scontrol requeue <job>` only
    when the run wrote OUTPUT_DIR/PREEMPTED (a stale marker of an earlier attempt is removed first)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "calls"
    (bindir / "deepspeed").write_text(FAKE_LAUNCHER.format(log=log))
    (bindir / "scontrol").write_text(f"#!/bin/bash\necho \"scontrol $*\" >> {log}\n")
    for f in bindir.iterdir():
        f.chmod(0o755)
    env = _sbatch_env(tmp_path, PATH=f"{bindir}:{os.environ['PATH']}", MARK=mark)
    os.makedirs(env["OUTPUT_DIR"])
    open(os.path.join(env["OUTPUT_DIR"], "PREEMPTED"), "w").close()  # stale: the last attempt's
    proc = subprocess.Popen(["bash", os.path.join(SLURM_DIR, "ppo_single_node.sbatch")], env=env, cwd=str(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(200):  # until the fake launcher has started its rank
        if log.exists() and subprocess.run(["pgrep", "-f", "LOCAL_RANK|while true; do sleep 0.05"],
                                           capture_output=True).stdout:
            break
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == rc, (out, err)  # the training command's exit code
    calls = log.read_text().splitlines()
    assert calls[0].startswith("deepspeed --num_gpus 4") and "--resume auto" in calls[0]
    assert "rank USR1" in calls and "launcher USR1" not in calls, calls
    assert os.path.exists(os.path.join(env["OUTPUT_DIR"], "PREEMPT_REQUESTED"))
    assert ("scontrol requeue 123456" in calls) == requeued, calls
    assert ("requeueing job 123456" in out) == requeued, out


def test_rollout_servers_sbatch_dry_run(tmp_path):
    """The heterogeneous job with rollout servers: one server per GPU of each rollout node, each task's command bound
    to its own GPU (the task's command run here as srun would, local id 3, a stand-in interpreter printing what it
    got) on its own port; the trainer lists every server, reads the job's token from the variable the servers read,
    and preemption signals no srun step (the servers would get USR1)."""
    import shlex

    env = _sbatch_env(tmp_path, RLHF_DRY_RUN="1", SLURM_JOB_NODELIST_HET_GROUP_1="gpu[11-12]",
                      SLURM_NTASKS_PER_NODE_HET_GROUP_1="4(x2)", MODEL="/models/actor",
                      SERVER_ARGS="--dtype bfloat16 --max_model_len 4096")
    proc = subprocess.run(["bash", os.path.join(SLURM_DIR, "ppo_rollout_servers.sbatch"), "--max_steps", "5"],
                          env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    servers, trainer = proc.stdout.strip().splitlines()[-2:]
    urls = ",".join(f"http://gpu{n}:{18556 + i}" for n in (11, 12) for i in range(4))
    assert shlex.split(trainer) == shlex.split(
        f"DRY RUN: OMP_NUM_THREADS=32 srun --het-group=0 --kill-on-bad-exit=1 --gpu-bind=none {sys.executable} -u "
        f"launch/train_ppo.py --output_dir {env['OUTPUT_DIR']} --resume auto --save_interval_minutes 30 "
        f"--generation_backend vllm --rollout_servers {urls} --rollout_auth_token_env RLHF_ROLLOUT_TOKEN "
        "--max_staleness 1 --max_steps 5")
    argv = shlex.split(servers.split(":", 1)[1])
    assert argv[:5] == ["srun", "--het-group=1", "--kill-on-bad-exit=0", "--gpu-bind=none", "bash"]
    stand_in = tmp_path / "python"
    stand_in.write_text('#!/bin/bash\necho "GPU=$CUDA_VISIBLE_DEVICES TOKEN=${RLHF_ROLLOUT_TOKEN:+set} $*"\n')
    stand_in.chmod(0o755)
    task = subprocess.run(argv[4:6] + [argv[6], str(stand_in)] + argv[8:], capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"], "SLURM_LOCALID": "3", "RLHF_ROLLOUT_TOKEN": "t"})
    assert task.returncode == 0, task.stderr
    assert task.stdout.strip() == ("GPU=3 TOKEN=set -u launch/rollout_server.py /models/actor --device cuda "
                                   "--port 18559 --auth_token_env RLHF_ROLLOUT_TOKEN --dtype bfloat16 "
                                   "--max_model_len 4096")
    with open(os.path.join(SLURM_DIR, "ppo_rollout_servers.sbatch")) as f:
        assert "RLHF_SIGNAL_STEPS=0" in f.read()
