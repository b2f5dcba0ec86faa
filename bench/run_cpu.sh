#!/usr/bin/env bash
# The CPU benchmark set behind bench/README.md, then the README itself (generated from the JSON results).
#
#   bash bench/run_cpu.sh                  everything (about 7 minutes on 2 cores)
#   bash bench/run_cpu.sh scaling readme   some steps: phases backends trim from_update scaling tokenize tiny
#                                          readme
#
# Results go to bench/results/cpu/*.json; models and run folders to $BENCH_WORK_DIR (default $TMPDIR/rlhf_bench).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
res=bench/results/cpu  # relative: the commands recorded in the results read the same on any checkout
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
export BENCH_WORK_DIR=${BENCH_WORK_DIR:-${TMPDIR:-/tmp}/rlhf_bench}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$(dirname "$py")/../torch_extensions}
mkdir -p "$res"
cd "$root"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(phases backends trim from_update scaling tokenize tiny readme)
timings=$res/run_cpu_timings.jsonl
[ $# -eq 0 ] && rm -f "$timings"

run() {  # name cmd...
    local name=$1; shift
    echo "== $name: $*"
    local t0; t0=$(date +%s)
    "$@"
    printf '{"step": "%s", "seconds": %s}\n' "$name" "$(( $(date +%s) - t0 ))" >> "$timings"
}

for step in "${steps[@]}"; do
    case "$step" in
        phases)
            run phases "$py" bench/ppo_iteration.py --preset cpu-small --variant zero0:zero=0 --variant zero2:zero=2 \
                --warmup 1 --iterations 4 --label phases --out "$res/phases.json"
            run phases_variable "$py" bench/ppo_iteration.py --preset cpu-small --variable-length \
                --variant zero0:zero=0 --warmup 1 --iterations 2 --label phases-variable \
                --out "$res/phases_variable.json" ;;
        backends)  # the lean backend (default) against Hugging Face generate, fixed lengths
            run backends "$py" bench/ppo_iteration.py --preset cpu-small --variant lean:backend=lean \
                --variant hf:backend=hf --warmup 1 --iterations 4 --label backends --out "$res/backends.json" ;;
        from_update)  # the actor's and critic's experience forwards from the update's, against their own: 2 ranks,
            # DeepSpeed-Chat's mid shape (H256 L4, 8 prompts/rank, 32+64 tokens, one micro-batch, ZeRO 2, bf16)
            run from_update "$(dirname "$py")/torchrun" --nproc_per_node 2 --master_port "$("$py" -c \
                'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')" \
                bench/ppo_iteration.py --preset cpu-small --global-batch 16 --micro-batch 8 --prompt-len 32 \
                --answer-len 64 --dtype bf16 --variant from_update:zero=2,from_update=1 \
                --variant experience_forwards:zero=2,from_update=0 --warmup 1 --iterations 8 --label from_update \
                --out "$res/experience_from_update.json" ;;
        trim)  # padding trimming (default on) with variable lengths
            run trim "$py" bench/ppo_iteration.py --preset cpu-small --variable-length --variant trim:trim=1 \
                --variant no_trim:trim=0 --warmup 1 --iterations 4 --label trim --out "$res/trim.json" ;;
        scaling)
            run scaling "$py" bench/scaling.py --preset cpu-small --repeats 2 --warmup 1 --iterations 2 \
                --out "$res/scaling.json" ;;
        tokenize)  # applied fix: tokenized data cached per node (no cache -> local rank 0 builds -> warm entry)
            run tokenize "$(dirname "$py")/torchrun" --nproc_per_node 2 --master_port "$("$py" -c \
                'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')" \
                bench/tokenize_cache.py --prompts 50000 --rounds 4 --out "$res/tokenize_cache.json" ;;
        tiny)
            run tiny bash bench/gpu.sh --tiny --out "$res/gpu-tiny" ;;
        readme)
            "$py" bench/make_readme.py ;;
        *) echo "run_cpu.sh: unknown step $step" >&2; exit 2 ;;
    esac
done
