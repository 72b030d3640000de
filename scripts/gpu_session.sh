#!/usr/bin/env bash
# Everything one 10-minute call on a lent GPU node can do, in an order that keeps the most
# valuable figures when the call is cut short (a session is lent about 15 minutes of device time,
# the machine's start included: one full call). Each part has its own budget in seconds:
#
#   probe   nvidia-smi, torch, Triton, cores                                  OUT/probe.txt
#   setup   scripts/gpu_check.sh --stage setup (venv over the image's Python, Horovod built
#           from WHEELHOUSE on SETUP_JOBS cores), in the background from the start; nothing but
#           cuda B waits for it (one process runs without Horovod: hvd_lm.comm.single)
#   cuda A  the one-process cuda tests, with the image's python3 (CUDA_A_S, 180)
#   bench   hvd-lm bench gpu at H=WIDTH, T=256: B=256 bf16 with a profiler window of the fastest
#           mLSTM variant (BENCH256_S, 75), then B=128 in bf16, fp32 and fp16 (BENCH128_S, 110):
#           cuDNN's LSTM, the fused recurrence (triton and torch kernels, CUDA graphs off and on)
#           and the reference, with the image's python3 and the tree on PYTHONPATH
#   model   hvd-lm train at H=WIDTH on DATA's shards with the fastest fused bf16 variant the
#           bench measured, with the image's python3, max_steps from its rate so that the LR
#           decays to 0 in the time left before POST_S (100) seconds of eval, transfer (SST-2
#           from DATA/sst2, fit on the GPU, on the mean of h_t), generate (plain, and the
#           sentiment unit pinned high and low), visualize, and last a second transfer on the
#           final cell state (the reference's), and CUDA_B_S for cuda B
#   cuda B  (setup done) the cuda tests that need Horovod: two GPUs under horovodrun (CUDA_B_S,
#           80; skipped on one GPU)
#   pack    OUT/gpu_session.tar.gz: logs, bench JSONs, metrics, reports, samples, the heatmap and
#           the checkpoint's sha256 (never the checkpoint)
#
# Every part ends by TOTAL_S (570) seconds after the start, under a 10-minute call.
#
#   bash scripts/gpu_session.sh [WHEELHOUSE] [DATA] [OUT]      (defaults: .whl, .gpu, gpu_session)
#
# DATA holds shards/ and sst2/ (train.csv, val.csv), made before the call by scripts/gpu_data.sh
# (gzip shards of the Amazon + IMDB-train text: it checks that DATA, the wheelhouse and the tree
# fit the 64 MiB the device tool carries). Environment: WIDTH (4096), TRAIN_BATCH (256),
# SETUP_JOBS (10: the Horovod build leaves the rest of the 16 cores to the tests and the bench),
# PYTHON (python3), the budgets above, SKIP (parts not to run, of "setup cudaA bench b256 b128
# cudaB model"), KERNELS (bench's --rnn-kernels: triton,torch), B256_PRECISIONS (bf16),
# B128_PRECISIONS (bf16,fp32,fp16), IMPL and RATE (the training's fused variant and its chars/s,
# e.g. "fused/triton 833765", instead of the bench's), DEVICE (cuda; cpu with SMALL=1 rehearses
# the script on a CPU machine at tiny shapes: tests/test_gpu_node.py).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
T0=$(date +%s)
DEADLINE=$((T0 + ${TOTAL_S:-570} - 10))  # 10 s kept for the pack
left() { echo $((DEADLINE - $(date +%s))); }  # seconds before the deadline
# budget N: N seconds, or what is left before the deadline when that is less (at least 5)
budget() { local l; l=$(left); ((l > $1)) && l=$1; ((l < 5)) && l=5; echo "$l"; }
say() { printf '[gpu_session +%ds] %s\n' "$(($(date +%s) - T0))" "$*"; }
WHEELS=${1:-.whl}
DATA=$(realpath -m "${2:-.gpu}")
OUT=$(realpath -m "${3:-gpu_session}")
mkdir -p "$OUT"
PY3=${PYTHON:-python3}
WIDTH=${WIDTH:-4096}
TRAIN_BATCH=${TRAIN_BATCH:-256}
DEVICE=${DEVICE:-cuda}
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
shape=(--hidden-size "$WIDTH" --seq-len 256)
kernels=${KERNELS:-triton,torch}
if [ "${SMALL:-0}" = 1 ]; then  # a rehearsal on the CPU: tiny shapes, the same steps
    shape=(--hidden-size "$WIDTH" --seq-len 16 --embed-dim 8 --matmul-size 64 --copy-mib 1
           --steps 1 --warmup 0 --repeats 1)
    kernels=${KERNELS:-torch}
fi

# ---- probe -------------------------------------------------------------------------------------
{
    nvidia-smi 2>&1 | head -15
    "$PY3" -c 'import sys, torch; print(sys.executable, sys.version.split()[0], "torch",
torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available() and
torch.cuda.get_device_name(0))'
    "$PY3" -c 'import triton; print("triton", triton.__version__)' 2>&1
    echo "cores $(nproc); $(command -v mpirun || echo 'no mpirun')"
} >"$OUT/probe.txt" 2>&1
cat "$OUT/probe.txt"

# ---- setup, in the background ------------------------------------------------------------------
skip() { [[ " ${SKIP:-} " == *" $1 "* ]]; }
if skip setup; then  # .venv as it is (tests: the suite's own venv)
    true &
else
    say "setup in the background (log: $OUT/gpu_check/setup.log)"
    MAKEFLAGS=-j${SETUP_JOBS:-10} STAGE_BUDGET=${SETUP_S:-400} \
        bash scripts/gpu_check.sh --stage setup "$WHEELS" "$OUT/gpu_check" >"$OUT/setup.out" 2>&1 &
fi
setup_pid=$!

# ---- cuda tests --------------------------------------------------------------------------------
NEED_HOROVOD="two_gpus"  # horovodrun -np 2; every other cuda test is one process
CUDA_FILES=(tests/test_cuda.py tests/test_mlstm_fused.py tests/test_transfer_fit.py)
cuda_tests() {  # cuda_tests PART PYTHON SECONDS SELECTION
    local secs
    secs=$(budget "$3")
    say "cuda tests $1 for at most $secs s"
    PYTHONPATH=$PWD timeout -s INT -k 10 "$secs" "$2" -m pytest -q -p no:cacheprovider -m cuda \
        -k "$4" --time-budget $((secs > 40 ? secs - 30 : 10)) --junitxml="$OUT/cuda_$1.xml" \
        "${CUDA_FILES[@]}" >"$OUT/cuda_$1.log" 2>&1
    say "cuda tests $1: exit $?"; tail -n 15 "$OUT/cuda_$1.log"
}
skip cudaA || cuda_tests A "$PY3" "${CUDA_A_S:-180}" "not ($NEED_HOROVOD)"

# ---- bench -------------------------------------------------------------------------------------
bench() {  # bench NAME SECONDS ARGS...
    local name=$1 secs
    secs=$(budget "$2")
    shift 2
    say "bench $name for at most $secs s"
    PYTHONPATH=$PWD timeout -s INT -k 10 "$secs" "$PY3" -m hvd_lm bench gpu --device "$DEVICE" \
        "${shape[@]}" --rnn-kernels "$kernels" --json "$OUT/bench_$name.json" "$@" \
        >"$OUT/bench_$name.log" 2>&1
    say "bench $name: exit $?"; tail -n 45 "$OUT/bench_$name.log"
}
skip bench || skip b256 || bench b256 "${BENCH256_S:-75}" --batch-sizes 256 \
    --precisions "${B256_PRECISIONS:-bf16}" --profile-steps 2
skip bench || skip b128 || bench b128 "${BENCH128_S:-110}" --batch-sizes 128 \
    --precisions "${B128_PRECISIONS:-bf16,fp32,fp16}"

# ---- the model: one process on the image's python3 (Horovod is not needed for one rank) --------
MPY=(env "PYTHONPATH=$PWD" "$PY3")
if skip model; then
    say "no model (SKIP)"
else
    RUN=$OUT/run
    # the fastest fused bf16 variant measured at TRAIN_BATCH (else at any batch), and its rate
    read -r impl rate < <("${MPY[@]}" - "$OUT" "$TRAIN_BATCH" <<'EOF'
import json, pathlib, sys
rows = []
for f in pathlib.Path(sys.argv[1]).glob("bench_*.json"):
    rows += [r for r in json.loads(f.read_text()).get("train", [])
             if r["impl"].startswith("fused") and r["precision"] == "bf16" and "chars_per_s" in r]
same = [r for r in rows if r["batch_size"] == int(sys.argv[2])] or rows
best = max(same, key=lambda r: r["chars_per_s"], default=None)
print(*((best["impl"], best["chars_per_s"]) if best else ("fused/auto", 3e5)))
EOF
    )
    impl=${IMPL:-$impl} rate=${RATE:-$rate}  # or as given
    kern=${impl#fused/}; graphs=false
    [ "${kern%+graphs}" != "$kern" ] && graphs=true
    kern=${kern%+graphs}
    after=$((${POST_S:-100} + 30))  # the steps after training; 30 s: start-up, the final eval
    skip cudaB || skip setup || after=$((after + ${CUDA_B_S:-80}))
    train_s=$(($(left) - after))
    ((train_s < 20)) && train_s=20
    steps=$("${MPY[@]}" -c "print(max(20, int($rate * $train_s / ($TRAIN_BATCH * 256))))")
    [ "${SMALL:-0}" = 1 ] && steps=20
    say "train H=$WIDTH B=$TRAIN_BATCH bf16 $impl at ${rate} chars/s measured: $steps steps"
    cat >"$OUT/train.yaml" <<EOF
model: {cell: mlstm, hidden_size: $WIDTH, embed_dim: 64, rnn_impl: fused, rnn_kernels: $kern,
        cuda_graphs: $graphs}
data: {shards: $DATA/shards, batch_size: $TRAIN_BATCH, seq_len: 256, seed: 1234}
optim: {optimizer: adam, lr: 5.0e-4, lr_ref_batch: 128, lr_rule: linear, warmup_steps: 50,
        lr_decay: linear, max_steps: $steps}
run: {out_dir: $RUN, precision: bf16, device: $DEVICE, log_every: 20, eval_every: 250,
      eval_chars: 0, checkpoint_minutes: 1.0}
EOF
    # SIGUSR1 (checkpoint, then stop) should the run outlast its budget
    timeout -s USR1 -k 30 "$(budget $((train_s + 40)))" "${MPY[@]}" -m hvd_lm train \
        --config "$OUT/train.yaml" >"$OUT/train.log" 2>&1
    say "train: exit $?"; tail -n 12 "$OUT/train.log"
    post() {  # post NAME COMMAND...: one step after training, within the steps' budget
        say "$1"; local name=$1; shift
        timeout -k 5 "$(budget "${POST_S:-100}")" "$@" >"$OUT/$name.log" 2>&1
        say "$name: exit $?"; tail -n 8 "$OUT/$name.log"
    }
    post eval "${MPY[@]}" -m hvd_lm eval "$RUN" "$DATA/shards" --precision bf16 \
        --device "$DEVICE" --output "$OUT/eval.json"
    post transfer "${MPY[@]}" -m hvd_lm transfer "$RUN" --dataset sst2 \
        --data-dir "$DATA/sst2" --features mean --precision bf16 --device "$DEVICE" \
        --out "$OUT/transfer" --c-grid 0.03,0.125,0.5 --no-progress --no-cache
    post generate "${MPY[@]}" -m hvd_lm generate "$RUN" --samples 3 --length 200 --seed 1 \
        --device "$DEVICE" --output "$OUT/samples.jsonl"
    for v in 1.0 -1.0; do
        post "generate_unit$v" "${MPY[@]}" -m hvd_lm generate "$RUN" --samples 3 --length 200 \
            --seed 1 --device "$DEVICE" --classifier "$OUT/transfer" --overwrite "$v" \
            --prime "This product is" --output "$OUT/samples_unit$v.jsonl"
    done
    # texts of our own (a heatmap of a dataset's sentences would publish them with the results)
    printf '%s\n' "This is the best album I have heard all year, every song is a gem." \
        "Terrible sound quality, the disc skipped and the songs are boring." \
        "I expected more, but the second half is wonderful." \
        "Arrived broken and the seller never answered my emails." \
        "Not bad for the price, though the strap feels cheap." >"$OUT/heatmap_texts.txt"
    post visualize "${MPY[@]}" -m hvd_lm visualize "$RUN" --classifier "$OUT/transfer" \
        --input "$OUT/heatmap_texts.txt" --format lines --device "$DEVICE" \
        --out "$OUT/heatmap.png"
    post transfer_cell "${MPY[@]}" -m hvd_lm transfer "$RUN" --dataset sst2 \
        --data-dir "$DATA/sst2" --features cell --precision bf16 --device "$DEVICE" \
        --out "$OUT/transfer_cell" --c-grid 0.03,0.125,0.5 --no-progress --no-cache --no-baseline
    find "$RUN" -name '*.pt' -exec sha256sum {} + >"$OUT/checkpoint.sha256" 2>/dev/null
fi

# ---- what needs Horovod, once setup is done ------------------------------------------------------
say "waiting for setup"
wait "$setup_pid"
setup_rc=$?
tail -n 8 "$OUT/setup.out" 2>/dev/null
[ "$setup_rc" = 0 ] && ! skip cudaB && cuda_tests B .venv/bin/python "${CUDA_B_S:-80}" \
    "$NEED_HOROVOD"

# ---- pack --------------------------------------------------------------------------------------
tar -C "$OUT" -czf "$OUT.tar.gz" --exclude='*.pt' --exclude='*.safetensors' \
    --exclude='*.npy' --exclude='*.npz' --exclude='cache' . 2>/dev/null
mv "$OUT.tar.gz" "$OUT/gpu_session.tar.gz"
say "done: $OUT/gpu_session.tar.gz ($(du -h "$OUT/gpu_session.tar.gz" | cut -f1))"
