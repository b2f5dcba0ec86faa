#!/usr/bin/env bash
# The prepared single-GPU benchmark: DeepSpeed-Chat's OPT example shapes, finishing in under 8 minutes.
#
#   bash bench/gpu.sh                  on the GPU machine (offline; its own Python, torch and transformers)
#   bash bench/gpu.sh --tiny           the same script and code path on CPU with tiny shapes (CI, ~1 minute)
#   options: --out DIR (default bench/results/gpu, or ...-tiny), --budget SECONDS (default 465)
#   env: PYTHON (default python3; --tiny: the repo's .venv when present), WHEELS (default bench/wheels),
#        BENCH_WORK_DIR (models, JIT cache, carried packages; default $TMPDIR/rlhf_bench_gpu[_tiny])
#
# Steps (each a separate process with its own time cap, all inside --budget; a step that runs out of time is
# killed and recorded as timed out, keeping the iterations it finished):
#   env     bench/gpu_env.py: deepspeed and its pure-Python dependencies (and accelerate) from the carried wheels
#           (bench/fetch_wheels.sh) into $BENCH_WORK_DIR/pydeps, put first on PYTHONPATH; torch is never reinstalled;
#           the project runs from this source tree (PYTHONPATH), not installed
#   models  random-weight OPT-1.3B-shaped actor and OPT-350M-shaped critic/reward from configs (bf16, cached)
#   zero2   K PPO iterations, 256 prompt + 256 generated tokens (fixed length), global batch 16, bf16, ZeRO-2
#   zero3   the same at ZeRO-3 (reference/reward at ZeRO-3 too)
#   vllm    the ZeRO-2 iterations with --generation_backend vllm (a vLLM engine fed the actor's weights), when vLLM is
#           installed for $PYTHON (pip install -e '.[vllm]'); else recorded as skipped
#   hybrid  last, with the time that is left: ZeRO-2 + DeepSpeed Hybrid Engine, first a greedy self-check
#           (HE kernels against the native HF path on the same weights), then PPO iterations. Skipped, with the
#           reason recorded, without a GPU or without the CUDA toolkit (its kernels are JIT-compiled)
#   summary bench/gpu_summary.py -> $OUT/gpu.json (everything above in one file) and $OUT/gpu.md
#
# --suite vllm (the colocated vLLM engine's GPU check, docs/rollout-engines.md; budget 540 s): env and models as
# above, then the ZeRO-2 iterations with --generation_backend vllm at each sleep level, every iteration recording
# what the whole GPU holds after the rollouts and at its end (the driver's reading: vLLM's pools too), the
# engine's start-up line (its gpu_memory_utilization, computed from the free memory) and its log-probs against the
# trainer's (rollout/logprob_diff_max):
#   vllm_sleep2   sleep level 2 (the default): KV cache and weights freed through training, all pushed again
#   vllm_sleep1   level 1: KV cache freed, weights offloaded to CPU memory
#   vllm_sleep0   level 0, the control: the engine stays resident (the end-of-iteration reading is highest here)
#   vllm_tp2      2 ranks, ZeRO-3, --vllm_tensor_parallel_size 2: one engine over both GPUs; recorded as skipped
#                 with fewer than 2 GPUs
# --tiny runs the same steps on CPU (cpu-small shapes: vLLM's CPU attention refuses the tiny ones' head size 16;
# sleep levels change nothing there, and vllm_tp2 runs on 2 CPU ranks) with PYTHON=.venv-vllm/bin/python.
#
# --suite async (rollout servers, docs/rollout-servers.md; budget 540 s; UNVERIFIED: no GPU has run it): env, then
#   async   bench/async_rollouts.py servers --device cuda: the GRPO example colocated on GPU 0, then through one
#           rollout server (launch/rollout_server.py) at max_staleness 0, 1 and 2 with partial rollouts, the server
#           on GPU 1 (or beside the trainer on the one GPU, a third of its memory), the weights over rlhf_gloo;
#           needs vLLM and the demo package for $PYTHON. Its CPU form: .venv-vllm/bin/python bench/async_rollouts.py
#           servers (no --tiny form: it is the same script on CPU, minutes long).
# Optimizer: torch's AdamW through DeepSpeed's `torch_adam` (no JIT build; a FusedAdam build would cost about a
# minute of the budget). BENCH_ADAM=auto uses DeepSpeed's FusedAdam when the CUDA toolkit (nvcc) is there.
# With nvcc, the Hybrid Engine's inference kernels are JIT-built in the background (nice 19) from the env step on,
# so the hybrid step finds them built; without nvcc the hybrid step is skipped with that reason.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tiny=0
suite=main
out=""
budget=${BENCH_BUDGET:-}

while [ $# -gt 0 ]; do
    case "$1" in
        --tiny) tiny=1 ;;
        --suite) suite=${2:-}; shift ;;
        --out) out=${2:-}; shift ;;
        --budget) budget=${2:-}; shift ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "gpu.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
py=${PYTHON:-python3}
if [ "$tiny" = 1 ] && [ -z "${PYTHON:-}" ] && [ -x "$root/.venv/bin/python" ]; then py=$root/.venv/bin/python; fi
if [ "$suite" = async ] && [ "$tiny" = 1 ]; then  # the servers' bench on CPU is the same script, minutes long
    echo "gpu.sh: --suite async has no --tiny form; the rollout servers' bench on CPU:" \
         ".venv-vllm/bin/python bench/async_rollouts.py servers (docs/rollout-servers.md)" >&2
    exit 2
fi
case "$suite" in main|vllm|async) ;; *) echo "gpu.sh: --suite main, vllm or async" >&2; exit 2 ;; esac
[ -n "$budget" ] || budget=$([ "$suite" = main ] && echo 465 || echo 540)
suffix=$([ "$tiny" = 1 ] && echo "_tiny" || echo "")
out=${out:-$root/bench/results/gpu${suffix/_/-}}
work=${BENCH_WORK_DIR:-${TMPDIR:-/tmp}/rlhf_bench_gpu$suffix}
mkdir -p "$out" "$work"
out=$(cd "$out" && pwd)
for f in steps.jsonl gpu.json gpu.md; do rm -f "$out/$f"; done
for step in env models zero2 zero3 vllm hybrid prebuild vllm_sleep2 vllm_sleep1 vllm_sleep0 vllm_tp2 async; do
    rm -f "$out/$step.json" "$out/$step.md" "$out/$step.log"
done
start=$(date +%s)

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$work/torch_extensions}
export BENCH_WORK_DIR=$work
if [ "$tiny" = 1 ]; then
    export CUDA_VISIBLE_DEVICES="" DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    preset=$([ "$suite" = vllm ] && echo cpu-small || echo cpu-tiny)
else
    preset=opt-1.3b
fi

elapsed() { echo $(( $(date +%s) - start )); }
record() {  # name rc elapsed cap
    printf '{"name": "%s", "rc": %s, "elapsed_s": %s, "cap_s": %s}\n' "$1" "$2" "$3" "$4" >> "$out/steps.jsonl"
}
has_timeout=$(command -v timeout >/dev/null 2>&1 && echo 1 || echo 0)
run_capped() {  # name cap cmd...: run with a hard time limit, log to $out/name.log
    local name=$1 cap=$2; shift 2
    local t0; t0=$(date +%s)
    if [ "$has_timeout" = 1 ]; then
        timeout --signal=TERM --kill-after=20 "$cap" "$@" > "$out/$name.log" 2>&1
    else
        "$@" > "$out/$name.log" 2>&1
    fi
    local rc=$?
    record "$name" "$rc" "$(( $(date +%s) - t0 ))" "$cap"
    echo "gpu.sh: $name rc=$rc after $(( $(date +%s) - t0 ))s (cap ${cap}s; ${out}/$name.log)"
    return $rc
}
cap_for() {  # wanted cap ('rest' = all that is left) -> the cap that fits the budget (20 s kept for the summary)
    local left=$(( budget - $(elapsed) - 20 ))
    local want=$1
    [ "$want" = rest ] && want=$left
    [ "$want" -gt "$left" ] && want=$left
    echo "$want"
}

# ---- env ----------------------------------------------------------------------------------------------------------
deps=$work/pydeps
run_capped env "$(cap_for 90)" "$py" "$root/bench/gpu_env.py" --wheels "${WHEELS:-$root/bench/wheels}" \
    --target "$deps" --report "$out/env.json"
env_rc=$?
export PYTHONPATH="$deps:$root${PYTHONPATH:+:$PYTHONPATH}" PATH="$deps/bin:$PATH"  # bin: ninja for JIT builds

prebuild_pid=""
if [ "$suite" = main ] && [ "$tiny" = 0 ] && [ "$env_rc" = 0 ] && "$py" -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1])).get("nvcc") else 1)' "$out/env.json"; then
    echo "gpu.sh: nvcc found: building the Hybrid Engine's inference kernels in the background ($out/prebuild.log)"
    launcher=nice; command -v setsid >/dev/null 2>&1 && launcher=setsid  # setsid: its own process group, killable
    if [ "$launcher" = setsid ]; then launcher_args=(setsid nice -n 19); else launcher_args=(nice -n 19); fi
    "${launcher_args[@]}" "$py" -c 'import time; t = time.time()
from deepspeed.ops.op_builder import InferenceBuilder
InferenceBuilder().load()
print(f"prebuild: transformer_inference ready after {time.time() - t:.0f}s")' > "$out/prebuild.log" 2>&1 &
    prebuild_pid=$!
fi

# ---- benchmark steps ----------------------------------------------------------------------------------------------
bench() {  # name cap args...
    local name=$1 cap; cap=$(cap_for "$2"); shift 2
    if [ "$env_rc" != 0 ]; then echo "gpu.sh: $name skipped: the environment is not ready ($out/env.json)"; \
        record "$name" '"skipped: environment not ready"' 0 0; return; fi
    if [ "$cap" -lt 30 ]; then echo "gpu.sh: $name skipped: no time left"; \
        record "$name" '"skipped: no time left in the budget"' 0 0; return; fi
    local launcher=("$py")  # BENCH_RANKS > 1: one launch of that many ranks (one GPU each)
    if [ "${BENCH_RANKS:-1}" -gt 1 ]; then
        launcher=("$py" -m torch.distributed.run --standalone --nproc_per_node "$BENCH_RANKS")
    fi
    run_capped "$name" "$cap" "${launcher[@]}" "$root/bench/ppo_iteration.py" --preset "$preset" --work-dir "$work" \
        --adam "${BENCH_ADAM:-torch}" --label "$name" --time-budget $(( cap - 30 )) --out "$out/$name.json" "$@"
}
if [ "$env_rc" = 0 ] && [ "$suite" != async ]; then
    run_capped models "$(cap_for 120)" "$py" "$root/bench/ppo_iteration.py" --preset "$preset" --work-dir "$work" \
        --prepare-only --out "$out/models.json"
fi
has_vllm=$("$py" -c 'import vllm' >/dev/null 2>&1 && echo 1 || echo 0)
skip_no_vllm() {  # step...
    for step in "$@"; do
        echo "gpu.sh: $step skipped: vLLM is not installed for $py (pip install -e '.[vllm]')"
        record "$step" '"skipped: vLLM not installed"' 0 0
    done
}
if [ "$suite" = async ]; then
    if [ "$has_vllm" != 1 ]; then
        skip_no_vllm async
    elif [ "$env_rc" != 0 ]; then
        record async '"skipped: environment not ready"' 0 0
    else
        run_capped async "$(cap_for rest)" "$py" "$root/bench/async_rollouts.py" servers --device cuda \
            --iterations 4 --work "$work/async" --out "$out/async.json"
    fi
elif [ "$suite" = vllm ]; then
    if [ "$has_vllm" = 1 ]; then
        for level in 2 1 0; do
            bench "vllm_sleep$level" 120 --variant "vllm_sleep$level:zero=2,backend=vllm,vllm_sleep=$level" \
                --warmup 1 --iterations 2
        done
        gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
        if [ "$tiny" = 1 ] || [ "$gpus" -ge 2 ]; then
            BENCH_RANKS=2 bench vllm_tp2 rest --variant vllm_tp2:zero=3,backend=vllm,vllm_tp=2 --warmup 1 \
                --iterations 2
        else
            echo "gpu.sh: vllm_tp2 skipped: tensor parallel 2 needs 2 GPUs, this machine has $gpus"
            record vllm_tp2 "\"skipped: tensor parallel 2 needs 2 GPUs, this machine has $gpus\"" 0 0
        fi
    else
        skip_no_vllm vllm_sleep2 vllm_sleep1 vllm_sleep0 vllm_tp2
    fi
else
    bench zero2 170 --variant zero2:zero=2 --warmup 1 --iterations 3
    bench zero3 170 --variant zero3:zero=3 --warmup 1 --iterations 2
    if [ "$has_vllm" = 1 ]; then  # the vllm generation backend (docs/rollout-engines.md)
        bench vllm 150 --variant zero2_vllm:zero=2,backend=vllm --warmup 1 --iterations 3
    else
        skip_no_vllm vllm
    fi
    bench hybrid rest --variant hybrid:zero=2,hybrid_engine=1 --greedy-check 8 --greedy-tokens 32 --warmup 1 \
        --iterations 2
fi

if [ -n "$prebuild_pid" ] && kill -0 "$prebuild_pid" 2>/dev/null; then  # still building: stop it (and its compilers)
    echo "prebuild: stopped at the end of the budget" >> "$out/prebuild.log"
    kill -- "-$prebuild_pid" 2>/dev/null || kill "$prebuild_pid" 2>/dev/null
fi

# ---- summary ------------------------------------------------------------------------------------------------------
"$py" "$root/bench/gpu_summary.py" --dir "$out" --budget "$budget" --elapsed "$(elapsed)" --tiny "$tiny"
rc=$?
echo "gpu.sh: done in $(elapsed)s; results in $out/gpu.json and $out/gpu.md"
exit $rc
