#!/usr/bin/env bash
# Everything one call on a lent GPU does, in one go: a session is lent 15 minutes of device
# time, the machine's start (2-4 minutes) included, so the card is spent in one call that ends
# by TOTAL_S (540) seconds after it starts, well inside the tool's 600 s. The parts run in this
# order, each bounded, so that what a short call cuts is the least valuable:
#
#   probe      nvidia-smi, torch, Triton, cores                                   probe.txt
#   cuda       the one-process cuda tests, the cpu -> cuda resume test first (CUDA_S, 60)
#   bench      hvd-lm bench gpu at H=WIDTH, T=256, B=256 and B=128 bf16: cuDNN's LSTM beside
#              the fused mLSTM's triton kernels eager and with CUDA graphs (BENCH_S, 80; a
#              profiler window of the fastest variant with PROFILE=1)
#   model      hvd-lm train at H=WIDTH, B=TRAIN_BATCH, bf16, with the fastest fused variant the
#              bench measured, on DATA/shards, --time-limit so that POST_S (130) seconds are
#              left: the LR reaches 0 and the final checkpoint is written by then
#   after it   eval of the final checkpoint on the val split; SST-2 transfer (DATA/sst2) on the
#              mean of h_t, the C grid two decades below 0.03; generate, plain and with the
#              sentiment unit pinned high and low; visualize; SST-2 transfer on the final cell
#              state (the reference's features), last: on one H200 these took 125 s in all
#              (eval 12, transfer 26, generate 11, pinned generates and visualize 36, the cell
#              transfer 40; docs/results/gpu_h200_2026-11-27/), hence POST_S
#   pack       OUT/gpu_session.tar.gz: logs (session.log: this script's own output), bench
#              JSONs, metrics, reports, samples, the heatmap and the final checkpoint's sha256
#              (never a checkpoint); the tool returns it
#
# No Horovod: one GPU trains as one process (hvd_lm.comm.single), on the image's python3 with
# the tree on PYTHONPATH; no build, no wheelhouse.
#
#   bash scripts/gpu_session.sh [DATA] [OUT]     (defaults: .gpu; $OUT, else ./gpu_session)
#
# DATA holds shards/ and sst2/, made here before the call by scripts/gpu_data.sh, which also
# prints the call to make. Work files go to WORK (default /tmp/hvd_lm_gpu_session), the tarball
# to OUT. Environment: WIDTH (4096), TRAIN_BATCH (256), PYTHON (python3), the budgets above,
# SKIP (parts not to run, of "cuda bench model"), TRAIN_S (the training's --time-limit, s;
# default: what is left less POST_S), KERNELS (bench's --rnn-kernels: triton),
# IMPL (the training's fused variant, e.g. fused/triton+graphs, instead of the bench's
# fastest), DEVICE (cuda; cpu with SMALL=1 rehearses the script on a CPU machine at tiny
# shapes: tests/test_gpu_node.py).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
T0=$(date +%s)
DEADLINE=$((T0 + ${TOTAL_S:-540} - 10))  # 10 s kept for the pack
left() { echo $((DEADLINE - $(date +%s))); }  # seconds before the deadline
# budget N: N seconds, or what is left before the deadline when that is less (at least 5)
budget() { local l; l=$(left); ((l > $1)) && l=$1; ((l < 5)) && l=5; echo "$l"; }
say() { printf '[gpu_session +%ds] %s\n' "$(($(date +%s) - T0))" "$*"; }
DATA=$(realpath -m "${1:-.gpu}")
OUT=$(realpath -m "${2:-${OUT:-gpu_session}}")
WORK=$(realpath -m "${WORK:-/tmp/hvd_lm_gpu_session}")
rm -rf "$WORK"
mkdir -p "$OUT" "$WORK"
exec > >(tee "$WORK/session.log") 2>&1  # the timeline travels in the tarball too
PY3=${PYTHON:-python3}
MPY=(env "PYTHONPATH=$PWD" "$PY3")
WIDTH=${WIDTH:-4096}
POST_S=${POST_S:-130}  # seconds kept after training for eval, transfer, generate, visualize
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

# ---- probe -------------------------------------------------------------------------------------
{
    nvidia-smi 2>&1 | head -15
    "$PY3" -c 'import sys, torch; print(sys.executable, sys.version.split()[0], "torch",
torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available() and
torch.cuda.get_device_name(0))'
    "$PY3" -c 'import triton; print("triton", triton.__version__)' 2>&1
    echo "cores $(nproc); data $(du -sh "$DATA" 2>/dev/null | cut -f1)"
} >"$WORK/probe.txt" 2>&1
cat "$WORK/probe.txt"

# ---- cuda tests: the cpu -> cuda resume first ---------------------------------------------------
if ! skip cuda; then
    secs=$(budget "${CUDA_S:-60}")
    say "cuda tests for at most $secs s"
    PYTHONPATH=$PWD timeout -s INT -k 10 "$secs" "$PY3" -m pytest -q -p no:cacheprovider -m cuda \
        --run-first 'test_checkpoint_moves_between_gpu_and_cpu[cpu-cuda]' \
        --time-budget $((secs > 30 ? secs - 20 : 10)) --junitxml="$WORK/cuda.xml" \
        tests/test_cuda.py tests/test_mlstm_fused.py tests/test_mlstm_fused_step.py \
        tests/test_transfer_fit.py \
        >"$WORK/cuda.log" 2>&1
    say "cuda tests: exit $?"; tail -n 15 "$WORK/cuda.log"
fi

# ---- bench -------------------------------------------------------------------------------------
if ! skip bench; then
    secs=$(budget "${BENCH_S:-80}")
    say "bench for at most $secs s"
    profile=()
    [ "${PROFILE:-0}" = 1 ] && profile=(--profile-steps 2)
    timeout -s INT -k 10 "$secs" "${MPY[@]}" -m hvd_lm bench gpu --device "$DEVICE" \
        "${shape[@]}" --rnn-kernels "$kernels" --batch-sizes "$TRAIN_BATCH,128" \
        --precisions bf16 --rnn-impl fused --json "$WORK/bench_gpu.json" "${profile[@]}" \
        >"$WORK/bench_gpu.log" 2>&1
    say "bench: exit $?"; tail -n 30 "$WORK/bench_gpu.log"
fi

# ---- the model ---------------------------------------------------------------------------------
if skip model; then
    say "no model (SKIP)"
else
    RUN=$WORK/run
    # the fastest fused bf16 variant measured at TRAIN_BATCH (else at any batch)
    impl=$("${MPY[@]}" - "$WORK/bench_gpu.json" "$TRAIN_BATCH" <<'EOF'
import json, pathlib, sys
f = pathlib.Path(sys.argv[1])
rows = [r for r in (json.loads(f.read_text()).get("train", []) if f.exists() else [])
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
    limit=${TRAIN_S:-$(($(left) - POST_S))}
    ((limit < 20)) && limit=20
    say "train H=$WIDTH B=$TRAIN_BATCH bf16 $impl for ${limit} s (--time-limit)"
    seq=256 evals=1000
    [ "${SMALL:-0}" = 1 ] && seq=16 evals=0
    cat >"$WORK/train.yaml" <<EOF
model: {cell: mlstm, hidden_size: $WIDTH, embed_dim: 64, rnn_impl: fused, rnn_kernels: $kern,
        cuda_graphs: $graphs}
data: {shards: $DATA/shards, batch_size: $TRAIN_BATCH, seq_len: $seq, seed: 1234}
optim: {optimizer: adam, lr: 5.0e-4, lr_ref_batch: 128, lr_rule: linear, warmup_steps: 50,
        lr_decay: linear}
run: {out_dir: $RUN, precision: bf16, device: $DEVICE, log_every: 20, eval_every: $evals,
      eval_chars: 0, checkpoint_minutes: 2.0, keep_checkpoints: 1, time_limit: ${limit}s}
EOF
    # the time limit ends it; SIGUSR1 (checkpoint, then stop) should it not
    timeout -s USR1 -k 30 $((limit + 30)) "${MPY[@]}" -m hvd_lm train \
        --config "$WORK/train.yaml" >"$WORK/train.log" 2>&1
    say "train: exit $?"; tail -n 6 "$WORK/train.log"
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
fi

# ---- pack --------------------------------------------------------------------------------------
tar -C "$WORK" -czf "$OUT/gpu_session.tar.gz" --exclude='*.pt' --exclude='*.safetensors' \
    --exclude='*.npy' --exclude='*.npz' --exclude='cache' . 2>/dev/null
say "done: $OUT/gpu_session.tar.gz ($(du -h "$OUT/gpu_session.tar.gz" | cut -f1))"
