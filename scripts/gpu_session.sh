#!/usr/bin/env bash
# What a lent GPU does, in two calls on the warm machine: a session is lent 15 minutes of device
# time (the machine's start included) and a call runs 600 s at most, while the machine keeps its
# files 30 s after a call. So the model trains in both calls, as one LR plan over two allocations
# (--time-budget, docs/training.md): call 1 trains the plan's first part and leaves the
# checkpoint on the machine, call 2 resumes it to the plan's end, then measures it.
#
#   PART=1 (default), call 1, TOTAL_S (585) seconds:
#     probe      nvidia-smi, torch, Triton, cores                                 probe.txt
#     cuda       the one-process cuda tests (CUDA_S, 60), only when their code changed
#     bench      python -m benchmarks gpu at H=WIDTH, T=256, B=TRAIN_BATCH and 128, bf16: cuDNN's LSTM
#                beside the fused mLSTM eager and with CUDA graphs (BENCH_S, 80), only when its
#                code changed
#     train      hvd-lm train at H=WIDTH, B=TRAIN_BATCH, bf16, the fastest fused variant
#                measured (this call's bench, else the last card's), --time-budget BUDGET_S
#                (default: this call's training + CALL2_TRAIN_S) and --time-limit = what is
#                left of the call: it stops with a checkpoint, the LR above 0
#     pack       OUT/gpu_session1.tar.gz (logs, bench, metrics; never a checkpoint)
#   PART=2, call 2 right after (within the 30 s the machine stays warm), TOTAL_S seconds (what
#   the device's budget has left, less a margin: docs/gpu.md gives the call):
#     train      --resume auto, --time-budget = the seconds trained in call 1 + what this call
#                leaves before POST_S: the plan's line bends to its new end (no jump) and the
#                LR reaches 0 there, with the final validation and checkpoint
#     after it   eval of the final checkpoint on the val split; SST-2 transfer (DATA/sst2) on
#                the mean of h_t (C by 5-fold cross-validation on train, TF-IDF beside it
#                under the same protocol); generate, plain and with the sentiment unit pinned
#                high and low; visualize; SST-2 transfer on the final cell state, last: on one
#                H200 these took 125 s in all (docs/results/gpu_h200_2026-11-27/), hence POST_S
#                (150, the cross-validation's folds on top)
#     pack       OUT/gpu_session2.tar.gz: logs (session1.log, session2.log: this script's own
#                output), metrics, reports, samples, the heatmap and the final checkpoint's
#                sha256 (never a checkpoint)
#
# Whether the code changed: the cuda tests' and the bench's files (CUDA_CODE, BENCH_CODE below)
# are hashed (sha256 of `sha256sum FILES`) and compared with the hashes in
# docs/results/gpu_checked.txt, written when a card's results are committed: the same hash means
# the last card ran that very code, and its figures stand. FORCE_CHECKS=1 runs both anyway.
#
# No Horovod: one GPU trains as one process (the torch engine's world of one), on the image's python3 with
# the tree on PYTHONPATH; no build, no wheelhouse.
#
#   PART=1 bash scripts/gpu_session.sh [DATA] [OUT]    (defaults: .gpu; $OUT, else ./gpu_session)
#
# DATA holds shards/ and sst2/, made here before the call by scripts/gpu_data.sh, which also
# prints the calls to make; call 1 copies it to WORK, where call 2 finds it (and the run) again.
# Work files go to WORK (default /tmp/hvd_lm_gpu_session), the tarballs to OUT. Environment:
# WIDTH (3072: the width that learns most in ~10 minutes of one H200, docs/gpu.md), TRAIN_BATCH
# (256), PYTHON (python3), the budgets above, SKIP (parts not to run, of "cuda bench model"),
# KERNELS (bench's --rnn-kernels: triton), IMPL (the training's fused variant, e.g.
# fused/triton+graphs, instead of the fastest measured), DEVICE (cuda; cpu with SMALL=1
# rehearses both calls on a CPU machine at tiny shapes: tests/test_gpu_node.py).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
T0=$(date +%s)
PART=${PART:-1}
[ "$PART" = 1 ] || [ "$PART" = 2 ] || { echo "PART must be 1 or 2, got '$PART'" >&2; exit 2; }
TOTAL_S=${TOTAL_S:-585}
DEADLINE=$((T0 + TOTAL_S - 10))  # 10 s kept for the pack
left() { echo $((DEADLINE - $(date +%s))); }  # seconds before the deadline
# budget N: N seconds, or what is left before the deadline when that is less (at least 5)
budget() { local l; l=$(left); ((l > $1)) && l=$1; ((l < 5)) && l=5; echo "$l"; }
say() { printf '[gpu_session %s +%ds] %s\n' "$PART" "$(($(date +%s) - T0))" "$*"; }
DATA=$(realpath -m "${1:-.gpu}")
OUT=$(realpath -m "${2:-${OUT:-gpu_session}}")
WORK=$(realpath -m "${WORK:-/tmp/hvd_lm_gpu_session}")
RUN=$WORK/run
if [ "$PART" = 1 ]; then
    rm -rf "$WORK"
    mkdir -p "$WORK"
    cp -r "$DATA" "$WORK/data" || { echo "ERROR: no data at $DATA" >&2; exit 2; }
elif [ ! -d "$RUN/checkpoints" ]; then
    echo "ERROR: no run at $RUN: call 2 resumes call 1's, on the same warm machine" >&2
    exit 2
fi
DATA=$WORK/data
mkdir -p "$OUT"
exec > >(tee "$WORK/session$PART.log") 2>&1  # the timeline travels in the tarball too
PY3=${PYTHON:-python3}
MPY=(env "PYTHONPATH=$PWD" "$PY3")
WIDTH=${WIDTH:-3072}
POST_S=${POST_S:-150}  # seconds kept after training for eval, transfer, generate, visualize
TRAIN_BATCH=${TRAIN_BATCH:-256}
DEVICE=${DEVICE:-cuda}
export PYTHONUNBUFFERED=1
shape=(--hidden-size "$WIDTH" --seq-len 256)
kernels=${KERNELS:-triton}
if [ "${SMALL:-0}" = 1 ]; then  # a rehearsal on the CPU: tiny shapes, the same steps
    shape=(--hidden-size "$WIDTH" --seq-len 16 --embed-dim 8 --matmul-size 64 --copy-mib 1
           --steps 1 --warmup 0 --repeats 1)
    kernels=${KERNELS:-torch}
fi
skip() { [[ " ${SKIP:-} " == *" $1 "* ]]; }
BENCH_CODE=(hvd_lm/model/*.py benchmarks/bench_gpu.py benchmarks/ceilings.py
            benchmarks/harness.py hvd_lm/train/step.py)
CUDA_CODE=("${BENCH_CODE[@]}" hvd_lm/formats/checkpoint.py hvd_lm/train/resume.py
           tests/test_cuda.py tests/test_mlstm_fused.py tests/test_mlstm_fused_step.py)
code_hash() {  # the files in C order, so that every machine hashes the same list
    printf '%s\n' "$@" | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-64
}
# changed NAME FILES...: true unless docs/results/gpu_checked.txt holds "NAME HASH" for them
changed() {
    local name=$1; shift
    [ "${FORCE_CHECKS:-0}" = 1 ] && return 0
    ! grep -qs "^$name $(code_hash "$@") " docs/results/gpu_checked.txt
}
pack() {  # pack NAME: the tarball the tool returns (never a checkpoint)
    tar -C "$WORK" -czf "$OUT/$1" --exclude='*.pt' --exclude='*.safetensors' \
        --exclude='*.npy' --exclude='*.npz' --exclude='cache' --exclude='data' . 2>/dev/null
    say "done: $OUT/$1 ($(du -h "$OUT/$1" | cut -f1))"
}
# trained: the seconds the run trained so far (its summary.json), 0 before
trained() {
    "${MPY[@]}" -c 'import json, sys; print(int(json.load(open(sys.argv[1])).get("trained_s", 0)))' \
        "$RUN/summary.json" 2>/dev/null || echo 0
}
# train LIMIT_S BUDGET_S [FLAGS...]: the model, until its limit or the plan's end
train() {
    local limit=$1 budget_s=$2; shift 2
    say "train H=$WIDTH B=$TRAIN_BATCH bf16 $impl: --time-limit ${limit}s, --time-budget" \
        "${budget_s}s $*"
    # the time limit ends it; SIGUSR1 (checkpoint, then stop) should it not
    timeout -s USR1 -k 30 $((limit + 30)) "${MPY[@]}" -m hvd_lm train \
        --config "$WORK/train.yaml" --time-limit "${limit}s" --time-budget "${budget_s}s" "$@" \
        >"$WORK/train$PART.log" 2>&1
    say "train: exit $?"; tail -n 6 "$WORK/train$PART.log"
}

if [ "$PART" = 1 ]; then
    # ---- probe ---------------------------------------------------------------------------------
    {
        nvidia-smi 2>&1 | head -15
        "$PY3" -c 'import sys, torch; print(sys.executable, sys.version.split()[0], "torch",
torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available() and
torch.cuda.get_device_name(0))'
        "$PY3" -c 'import triton; print("triton", triton.__version__)' 2>&1
        echo "cores $(nproc); data $(du -sh "$DATA" 2>/dev/null | cut -f1)"
        echo "code: bench $(code_hash "${BENCH_CODE[@]}") cuda $(code_hash "${CUDA_CODE[@]}")"
    } >"$WORK/probe.txt" 2>&1
    cat "$WORK/probe.txt"

    # ---- cuda tests: the cpu -> cuda resume first, when their code changed ---------------------
    if skip cuda; then
        :
    elif ! changed cuda "${CUDA_CODE[@]}"; then
        say "cuda tests: their code is the one the last card ran (docs/results/gpu_checked.txt)"
    else
        secs=$(budget "${CUDA_S:-60}")
        say "cuda tests for at most $secs s"
        PYTHONPATH=$PWD timeout -s INT -k 10 "$secs" "$PY3" -m pytest -q -p no:cacheprovider \
            -m cuda --run-first 'test_checkpoint_moves_between_gpu_and_cpu[cpu-cuda]' \
            --time-budget $((secs > 30 ? secs - 20 : 10)) --junitxml="$WORK/cuda.xml" \
            tests/test_cuda.py tests/test_mlstm_fused.py tests/test_mlstm_fused_step.py \
            >"$WORK/cuda.log" 2>&1
        say "cuda tests: exit $?"; tail -n 15 "$WORK/cuda.log"
    fi

    # ---- bench, when its code changed ------------------------------------------------------------
    if skip bench; then
        :
    elif ! changed bench "${BENCH_CODE[@]}"; then
        say "bench: its code is the one the last card ran (docs/results/gpu_checked.txt)"
    else
        secs=$(budget "${BENCH_S:-80}")
        say "bench for at most $secs s"
        profile=()
        [ "${PROFILE:-0}" = 1 ] && profile=(--profile-steps 2)
        timeout -s INT -k 10 "$secs" "${MPY[@]}" -m benchmarks gpu --device "$DEVICE" \
            "${shape[@]}" --rnn-kernels "$kernels" --batch-sizes "$TRAIN_BATCH,128" \
            --precisions bf16 --rnn-impl fused --json "$WORK/bench_gpu.json" "${profile[@]}" \
            >"$WORK/bench_gpu.log" 2>&1
        say "bench: exit $?"; tail -n 30 "$WORK/bench_gpu.log"
    fi
fi

# ---- the model ---------------------------------------------------------------------------------
if skip model; then
    say "no model (SKIP)"
    pack "gpu_session$PART.tar.gz"
    exit 0
fi
if [ "$PART" = 1 ]; then
    # the fastest fused bf16 variant measured at TRAIN_BATCH (else at any batch): this call's
    # bench, else the last card's (the newest docs/results/gpu_checked.txt names)
    last=$(awk '$1 == "bench" {print $3}' docs/results/gpu_checked.txt 2>/dev/null | tail -n 1)
    bench=$WORK/bench_gpu.json
    [ -f "$bench" ] || bench=docs/results/$last/bench_gpu.json
    impl=$("${MPY[@]}" - "$bench" "$TRAIN_BATCH" <<'EOF'
import json, pathlib, sys
f = pathlib.Path(sys.argv[1])
rows = [r for r in (json.loads(f.read_text()).get("train", []) if f.is_file() else [])
        if r["impl"].startswith("fused") and r["precision"] == "bf16" and "chars_per_s" in r]
same = [r for r in rows if r["batch_size"] == int(sys.argv[2])] or rows
best = max(same, key=lambda r: r["chars_per_s"], default=None)
print(best["impl"] if best else "fused/auto")
EOF
    )
    impl=${IMPL:-$impl}
    kern=${impl#fused/}; graphs=false
    [ "${kern%+graphs}" != "$kern" ] && graphs=true
    kern=${kern%+graphs}
    seq=256 evals=1000
    [ "${SMALL:-0}" = 1 ] && seq=16 evals=0
    echo "$impl" >"$WORK/impl.txt"
    cat >"$WORK/train.yaml" <<EOF
model: {cell: mlstm, hidden_size: $WIDTH, embed_dim: 64, rnn_impl: fused, rnn_kernels: $kern,
        cuda_graphs: $graphs}
data: {shards: $DATA/shards, batch_size: $TRAIN_BATCH, seq_len: $seq, seed: 1234}
optim: {optimizer: adam, lr: 5.0e-4, lr_ref_batch: 128, lr_rule: linear, warmup_steps: 50,
        lr_decay: linear}
run: {out_dir: $RUN, precision: bf16, device: $DEVICE, log_every: 20, eval_every: $evals,
      eval_chars: 0, checkpoint_minutes: 2.0, keep_checkpoints: 1}
EOF
    limit=$(($(left) - 5))
    ((limit < 20)) && limit=20
    # the plan: this call's training and call 2's (CALL2_TRAIN_S, less its start-up); call 2
    # moves the end to what its time allows
    BUDGET_S=${BUDGET_S:-$((limit - 30 + ${CALL2_TRAIN_S:-100}))}
    train "$limit" "$BUDGET_S"
    pack gpu_session1.tar.gz
    exit 0
fi

# ---- call 2: the plan's end, then what is measured on the model --------------------------------
impl=$(cat "$WORK/impl.txt")
limit=$(($(left) - POST_S))
trained_s=$(trained)
RESUME_S=${RESUME_S:-40}  # the resumed process's start: the budget is what its loop may train,
if ((limit >= RESUME_S + 20)); then  # so the plan ends (LR 0, validation, checkpoint) in time
    train "$limit" $((trained_s + limit - RESUME_S)) --resume auto
else
    say "no time to train in this call ($limit s before POST_S): the model is call 1's"
fi
post() {  # post NAME COMMAND...: one step after training, within what is left
    say "$1"; local name=$1; shift
    timeout -k 5 "$(budget "$POST_S")" "$@" >"$WORK/$name.log" 2>&1
    say "$name: exit $?"; tail -n 6 "$WORK/$name.log"
}
grid=0.0003,0.001,0.003,0.01,0.03,0.125,0.5  # two decades below the last card's 0.03
post eval "${MPY[@]}" -m hvd_lm eval "$RUN" "$DATA/shards" --precision bf16 \
    --device "$DEVICE" --output "$WORK/eval.json"
post transfer "${MPY[@]}" -m hvd_lm transfer "$RUN" --dataset sst2 \
    --data-dir "$DATA/sst2" --features mean --precision bf16 --device "$DEVICE" \
    --out "$WORK/transfer" --c-grid "$grid" --no-progress --no-cache
post generate "${MPY[@]}" -m hvd_lm generate "$RUN" --samples 3 --length 200 --seed 1 \
    --device "$DEVICE" --output "$WORK/samples.jsonl"
for v in 1.0 -1.0; do
    post "generate_unit$v" "${MPY[@]}" -m hvd_lm generate "$RUN" --samples 3 --length 200 \
        --seed 1 --device "$DEVICE" --classifier "$WORK/transfer" --overwrite "$v" \
        --prime "This product is" --output "$WORK/samples_unit$v.jsonl"
done
# texts of our own (a heatmap of a dataset's sentences would publish them with the results)
printf '%s\n' "This is the best album I have heard all year, every song is a gem." \
    "Terrible sound quality, the disc skipped and the songs are boring." \
    "I expected more, but the second half is wonderful." \
    "Arrived broken and the seller never answered my emails." \
    "Not bad for the price, though the strap feels cheap." >"$WORK/heatmap_texts.txt"
post visualize "${MPY[@]}" -m hvd_lm visualize "$RUN" --classifier "$WORK/transfer" \
    --input "$WORK/heatmap_texts.txt" --format lines --device "$DEVICE" \
    --out "$WORK/heatmap.png"
post transfer_cell "${MPY[@]}" -m hvd_lm transfer "$RUN" --dataset sst2 \
    --data-dir "$DATA/sst2" --features cell --precision bf16 --device "$DEVICE" \
    --out "$WORK/transfer_cell" --c-grid "$grid" --no-progress --no-cache --no-baseline
find "$RUN" -name '*.pt' -exec sha256sum {} + >"$WORK/checkpoint.sha256" 2>/dev/null
pack gpu_session2.tar.gz
