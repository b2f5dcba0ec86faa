#!/usr/bin/env bash
# A realistic side by side: SmolLM2-135M-Instruct (49k vocabulary, real EOS, variable lengths, no minimum response
# length) as the actor of DeepSpeed-Chat step 3 and of launch/train_ppo.py, critic and reward on the same backbone,
# ZeRO 2/2, 2 ranks (deepspeed launcher, gloo), OMP_NUM_THREADS=1, greedy decoding in both (DeepSpeed-Chat forces it
# for llama-type models). Launches alternate ours / theirs ROUNDS times; an iteration is the time between two
# end-of-iteration stamps (the shared peer's shims.py), the first 2 dropped; median per launch, then over launches.
# DeepSpeed-Chat pads every prompt to max_prompt_seq_len (P) and drops answers of <= 1 token; we pad to the batch.
#
#   bash bench/smollm_side_by_side.sh [ROUNDS ITERS B P R DTYPE]     (defaults: 3 8 2 64 48 bf16)
#   env: PEER = the shared peer folder (prep_dschat.sh, shims.py; default ../shared/peer), DSC = where DeepSpeed-Chat is
#   unpacked (default /tmp/dschat/applications/DeepSpeed-Chat), VENV = our venv (default .venv), W = work folder,
#   OUT = the result JSON (default bench/results/cpu/smollm_side_by_side.json; its previous headline is kept as "before"),
#   GENS = our generation backends, each a launch per round (default "lean"; "lean vllm" adds the vllm backend, run
#   from VLLM_VENV, default .venv-vllm: bash scripts/install.sh --vllm).
# Measurement only: DeepSpeed-Chat's code is run from its own checkout, never copied into the project.
set -u
ROUNDS=${1:-3} ITERS=${2:-8} B=${3:-2} P=${4:-64} R=${5:-48} DT=${6:-bf16}
PROJ=$(cd "$(dirname "$0")/.." && pwd)
PEER=${PEER:-$PROJ/../shared/peer}; VENV=${VENV:-$PROJ/.venv}; DSC=${DSC:-/tmp/dschat/applications/DeepSpeed-Chat}
W=${W:-/tmp/bench_smollm}; A=$W/assets; GENS=${GENS:-lean}; VLLM_VENV=${VLLM_VENV:-$PROJ/.venv-vllm}
export DSC OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu HF_HUB_OFFLINE=1 WANDB_MODE=offline
bash "$PEER/prep_dschat.sh" || exit 1
mkdir -p "$W"
# the assets are rebuilt every time: the DeepSpeed-Chat data folder is shared with the peer's own harness
PYTHONPATH=$PROJ:$DSC "$VENV/bin/python" "$PROJ/bench/smollm_assets.py" "$A" "$DSC/data" > "$W/assets.log" 2>&1 \
  || { echo "assets failed: $W/assets.log"; exit 1; }
theirs() {
  rm -rf "$W/dsdata" "$W/dsout"
  (cd "$DSC" && PYTHONPATH=$DSC timeout 2400 "$VENV/bin/deepspeed" --num_gpus 2 --master_port $((29700 + RANDOM % 200)) \
    "$PEER/shims.py" dschat training/step3_rlhf_finetuning/main.py --data_path local/jsonfile --data_split 2,4,4 \
    --data_output_path "$W/dsdata" --num_padding_at_beginning 0 --enable_test_mode --test_stop_step "$ITERS" \
    --output_dir "$W/dsout" --seed 1 --actor_model_name_or_path "$A/actor" --critic_model_name_or_path "$A/critic" \
    --per_device_generation_batch_size "$B" --per_device_training_batch_size "$B" --generation_batches 1 \
    --ppo_epochs 1 --max_prompt_seq_len "$P" --max_answer_seq_len "$R" --actor_zero_stage 2 --critic_zero_stage 2 \
    --dtype "$DT" --actor_learning_rate 1e-6 --critic_learning_rate 1e-6 --deepspeed)
}
ours() {  # ours GEN: one launch generating with backend GEN
  local gen=$1 venv=$VENV
  [ "$gen" = vllm ] && venv=$VLLM_VENV
  rm -rf "$W/ourout_$gen"
  (cd "$PROJ" && PYTHONPATH=$PROJ timeout 2400 "$venv/bin/deepspeed" --num_gpus 2 --master_port $((29500 + RANDOM % 200)) \
    "$PEER/shims.py" ours launch/train_ppo.py --actor_model_name_or_path "$A/actor" \
    --critic_model_name_or_path "$A/reward" --data_path "$A/prompts.jsonl" --per_device_generation_batch_size "$B" \
    --per_device_training_batch_size "$B" --generation_batches 1 --ppo_epochs 1 --max_prompt_seq_len "$P" \
    --max_answer_seq_len "$R" --do_sample false --actor_zero_stage 2 --critic_zero_stage 2 --reference_zero_stage 0 \
    --reward_zero_stage 0 --dtype "$DT" --actor_learning_rate 1e-6 --critic_learning_rate 1e-6 --max_steps "$ITERS" \
    --seed 1 --output_dir "$W/ourout_$gen" --data_cache_dir none --export_final false --generation_backend "$gen")
}
med() {
  "$VENV/bin/python" - "$1" <<'PY'
import re, statistics, sys
ts = [float(m.group(1)) for m in re.finditer(r"ITER_STAMP 0 ([0-9.]+)", open(sys.argv[1]).read())]
d = [b - a for a, b in zip(ts, ts[1:])][2:]
print(f"{statistics.median(d):.4f} {len(d)}" if d else "nan 0")
PY
}
: > "$W/summary.txt"
for i in $(seq 1 "$ROUNDS"); do
  for gen in $GENS; do
    ours "$gen" > "$W/ours_${gen}_$i.log" 2>&1; echo "ours_$gen rc=$? $(med "$W/ours_${gen}_$i.log")" >> "$W/summary.txt"
  done
  theirs > "$W/theirs_$i.log" 2>&1; echo "theirs rc=$? $(med "$W/theirs_$i.log")" >> "$W/summary.txt"
done
cat "$W/summary.txt"
OUT=${OUT:-$PROJ/bench/results/cpu/smollm_side_by_side.json}
PYTHONPATH=$PROJ/bench "$VENV/bin/python" - "$W" "$OUT" "$ROUNDS $ITERS $B $P $R $DT" "$GENS" <<'PY'
import json, os, statistics, sys, time
import benchlib as bl
from side_by_side import theirs_latencies
w, out_path, args, gens = sys.argv[1:]
rounds, iters, b, p, r, dt = args.split()
gens = gens.split()
per = {k: [] for k in ["theirs"] + [f"ours_{g}" for g in gens]}
for line in open(os.path.join(w, "summary.txt")):
    k, rc, m, n = line.split()
    if m != "nan" and int(n) >= 3:  # DS-Chat exits 1 after its iterations under transformers 5: count the stamps
        per[k].append(float(m))
o, t = per[f"ours_{gens[0]}"], per["theirs"]


def phases(gen):
    recs = bl.read_jsonl(os.path.join(w, f"ourout_{gen}", "metrics.jsonl")) or []
    return recs, {k: [round(x[f"time/{k}"], 3) for x in recs[2:]] for k in ("generate", "experience", "train")}


recs, first_phases = phases(gens[0])
lengths = [x["rollout/response_length"] for x in recs if "rollout/response_length" in x]
before = bl.read_json(out_path)  # the previous result's headline, kept as "before"
mach = bl.machine_info()
res = {"what": f"bench/smollm_side_by_side.sh {args}: SmolLM2-135M-Instruct as the actor of DeepSpeed-Chat step 3 "
               "and of launch/train_ppo.py; critic and reward on the same backbone (DeepSpeed-Chat's RewardModel / "
               f"LlamaForSequenceClassification); ZeRO 2/2, {dt}, 2 ranks (deepspeed launcher, gloo), "
               f"OMP_NUM_THREADS=1; {b} prompts per rank, chat-formatted review openings (DeepSpeed-Chat pads them to "
               f"{p}), greedy decoding to EOS or {r} tokens; 1 PPO epoch; {iters} iterations per launch, first 2 "
               "dropped, median per launch; launches alternate ours / theirs",
       "machine": f"{mach.get('cpu')} (flags: {' '.join(mach.get('cpu_flags') or [])}), {mach.get('cpu_count')} cores, "
                  f"{mach.get('ram_gib')} GiB",
       "date": time.strftime("%Y-%m-%d"), "commit": bl.git_commit(),
       "ours_s_per_iteration": o, "theirs_s_per_iteration": t,
       "ratio": statistics.median(o) / statistics.median(t) if o and t else None,
       "our_mean_response_length": statistics.mean(lengths) if lengths else None,
       "ours_backend": gens[0],
       "ours_phases_s": first_phases | {"note": "iterations 2 onwards of the last launch of ours (time/* metrics)"},
       "theirs_printed_s": theirs_latencies(open(os.path.join(w, "theirs_1.log")).read())
       | {"answer_length": int(r), "note": "DeepSpeed-Chat's own print_throughput_step3 lines of its first launch "
                                           "(generation; train_rlhf; its experience forwards are in neither)"}}
for g in gens[1:]:  # the other backends, launched in the same rounds
    og = per[f"ours_{g}"]
    recs_g, ph = phases(g)
    lens = [x["rollout/response_length"] for x in recs_g if "rollout/response_length" in x]
    res.setdefault("variants", {})[g] = {
        "s_per_iteration": og, "ratio": statistics.median(og) / statistics.median(t) if og and t else None,
        f"over_{gens[0]}": statistics.median(og) / statistics.median(o) if og and o else None,
        "mean_response_length": statistics.mean(lens) if lens else None,
        "weight_sync_s": [round(x["time/weight_sync"], 3) for x in recs_g[2:] if "time/weight_sync" in x],
        "phases_s": ph}
if before and before.get("ratio"):
    res["before"] = {k: before[k] for k in ("date", "commit", "ours_s_per_iteration", "theirs_s_per_iteration",
                                            "ratio")}
bl.write_json(out_path, res)
print(json.dumps({k: res.get(k) for k in ("ours_s_per_iteration", "theirs_s_per_iteration", "ratio", "variants")}))
PY
