#!/usr/bin/env bash
# The data a lent GPU node trains on, made here before the call: scripts/gpu_session.sh reads
# DEST/shards (HDF5 shards + manifest) and DEST/sst2 (train.csv, val.csv). The device tool carries
# the working tree, the wheelhouse and DEST together, 64 MiB at most, so the shards are
# gzip-compressed HDF5 (--compression gzip: the 52.8 MB of Amazon + IMDB-train review text in
# about 20 MiB; training reads them as it reads plain shards) and the script ends by stating the
# total that would travel, failing above MAX_CARRY_MIB (default 64).
#
#   bash scripts/gpu_data.sh [DEST] [WHEELHOUSE]          (defaults: .gpu and .whl)
#
# Text: every Amazon source in SHARED (default ../shared/data; the Blitzer *.review files, the
# McAuley JSON lines, the TSV and both CSVs) and, unless IMDB=0, the 25,000 IMDB train reviews
# (read from aclImdb_train.tar.gz as it ships: --tar-members). Split 200,1,1 by document (the
# val split, about 230 KB, is what training and `hvd-lm eval` score); documents under 20
# characters are dropped. PYTHON (default python3) must import hvd_lm.
# Keep DEST and the wheelhouse out of git (.gitignore lists /.gpu/ and /.whl/).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=$(realpath -m "${1:-.gpu}")
WHEELS=${2:-.whl}
SHARED=${SHARED:-../shared/data}
PY=${PYTHON:-python3}
MAX_CARRY_MIB=${MAX_CARRY_MIB:-64}
A=$SHARED/amazon
inputs=("$A"/mcauley2014_5core/*.json.gz "$A"/blitzer_mdsd/sorted_data_acl/*/*.review.gz
        "$A"/amazon_customer_reviews_us/*.tsv.gz "$A"/kaggle_musical_instruments/*.csv.gz
        "$A"/amazon_fine_food/*.csv.gz)
[ "${IMDB:-1}" = 1 ] && inputs+=("$SHARED/imdb/aclImdb_train.tar.gz")
for f in "${inputs[@]}" "$SHARED/sst2/train.csv" "$SHARED/sst2/val.csv"; do
    [ -f "$f" ] || { echo "ERROR: $f not found (SHARED=$SHARED)" >&2; exit 2; }
done
mkdir -p "$DEST"
"$PY" -m hvd_lm prepare "${inputs[@]}" --tar-members '*/train/pos/*.txt,*/train/neg/*.txt' \
    --out "$DEST/shards" --overwrite --split 200,1,1 \
    --shard-size 16M --compression gzip --min-chars 20 --workers "${WORKERS:-2}" --no-progress
rm -rf "$DEST/sst2"
mkdir -p "$DEST/sst2"
cp "$SHARED/sst2/train.csv" "$SHARED/sst2/val.csv" "$DEST/sst2/"
chmod -R u+w "$DEST/sst2"

# what the device tool would send: tracked and untracked-not-ignored files, DEST, the wheelhouse
# (a tracked file deleted in the work tree is listed but does not travel: du skips it)
tree=$(git ls-files -z --cached --others --exclude-standard \
       | { du -cb --files0-from=- 2>/dev/null || true; } | tail -n 1 | cut -f1)
carried=$(du -sb "$DEST" | cut -f1)
wheels=0
[ -d "$WHEELS" ] && wheels=$(du -sb "$WHEELS" | cut -f1)
total=$((tree + carried + wheels))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
echo "carry: $(mib "$total") MiB of $MAX_CARRY_MIB (tree $(mib "$tree"), $DEST $(mib "$carried")," \
     "$WHEELS $(mib "$wheels"))"
if ((total > MAX_CARRY_MIB * 1048576)); then
    echo "ERROR: $(mib "$total") MiB would travel, over MAX_CARRY_MIB=$MAX_CARRY_MIB" >&2
    exit 1
fi
