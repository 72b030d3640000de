#!/usr/bin/env bash
# The data a lent GPU node trains on, made here before the calls, and the two `run` calls that
# spend the card: scripts/gpu_session.sh reads DEST/shards (HDF5 shards + manifest) and
# DEST/sst2 (train.csv, val.csv). The device tool carries the working tree and DEST together,
# 64 MiB at most, and nothing else is needed there (the model trains as one process: no
# Horovod, no wheelhouse), so the shards are gzip-compressed HDF5 (--compression gzip; training
# reads them as it reads plain shards) and the script ends by stating what would travel,
# failing above MAX_CARRY_MIB (64), then prints the call to make.
#
#   bash scripts/gpu_data.sh [DEST]          (default: .gpu)
#
# Text: every review source of SHARED (default ../shared/data; its README, part 2, gives each
# file's format and text field) but SST-2, which the transfer scores: the Amazon files of
# amazon/ (Blitzer .review, McAuley JSON lines, the TSV, the CSVs) and amazon_more/, IMDB's
# train reviews (pos/neg) and its 47,589 unlabeled ones (unsup), read from the tarballs as they
# ship (--tar-members: the reviews, not the URL lists), and Pang & Lee's movie reviews: about
# 136 MB of review text, ~59 MB as gzip shards, made in ~11 s on 2 cores. Each file's text
# field is the first of --text-field's list it has (#5: the one CSV without a header row). Two
# files are read as they are or left out: the fastText lines (amazon_polarity_fasttext) keep
# their `__label__N ` prefix (text lines: 1% of the corpus), and Pet_Supplies_5's single
# pandas column-layout JSON document (3 MB of text) is left out (prepare reads JSON lines).
# Carrying these shards beats preparing the raw files on the card (59 MB of .gz/.tar.gz fit
# too): nothing to do there, where preparing would take seconds of the card's time (the
# tarballs are one stream each). Split 200,1,1 by document (the val split, ~0.7 MB, is what
# training and `hvd-lm eval` score); documents under 20 characters are dropped. PYTHON (default
# python3) must import hvd_lm. CHECK_ONLY=1 prepares nothing: it states what would travel with
# DEST as it is (after the tree changed). Keep DEST out of git (.gitignore lists /.gpu/).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=$(realpath -m "${1:-.gpu}")
SHARED=${SHARED:-../shared/data}
PY=${PYTHON:-python3}
MAX_CARRY_MIB=${MAX_CARRY_MIB:-64}
A=$SHARED/amazon
M=$SHARED/amazon_more
inputs=("$A"/mcauley2014_5core/*.json.gz "$A"/blitzer_mdsd/sorted_data_acl/*/*.review.gz
        "$A"/amazon_customer_reviews_us/*.tsv.gz "$A"/kaggle_musical_instruments/*.csv.gz
        "$A"/amazon_fine_food/*.csv.gz)
for f in "$M"/*/*; do  # every amazon_more file but the pandas-layout JSON (above)
    [[ $f == *Pet_Supplies_5.reviewText_first7000.json.gz ]] || inputs+=("$f")
done
inputs+=("$SHARED/imdb/aclImdb_train.tar.gz" "$SHARED/imdb/aclImdb_unsup.tar.gz"
         "$SHARED/movie_reviews/pang_lee_polarity_v2.0/review_polarity.tar.gz")
for f in "${inputs[@]}" "$SHARED/sst2/train.csv" "$SHARED/sst2/val.csv"; do
    [ -f "$f" ] || { echo "ERROR: $f not found (SHARED=$SHARED)" >&2; exit 2; }
done
mkdir -p "$DEST"
[ "${CHECK_ONLY:-0}" = 1 ] || "$PY" -m hvd_lm prepare "${inputs[@]}" \
    --tar-members '*/train/pos/*.txt,*/train/neg/*.txt,*/train/unsup/*.txt,*txt_sentoken/pos/*.txt,*txt_sentoken/neg/*.txt' \
    --text-field 'reviewText,review_body,review_text,Text,ReviewBody,Reviews,reviewDescription,review,reviews.text,#5' \
    --out "$DEST/shards" --overwrite --split 200,1,1 --shard-size 16M --compression gzip \
    --min-chars 20 --workers "${WORKERS:-2}" --no-progress
if [ "${CHECK_ONLY:-0}" != 1 ]; then
    rm -rf "$DEST/sst2"
    mkdir -p "$DEST/sst2"
    cp "$SHARED/sst2/train.csv" "$SHARED/sst2/val.csv" "$DEST/sst2/"
    chmod -R u+w "$DEST/sst2"
fi

# what the device tool would send: tracked and untracked-not-ignored files, and DEST
# (a tracked file deleted in the work tree is listed but does not travel: du skips it)
tree=$(git ls-files -z --cached --others --exclude-standard \
       | { du -cb --files0-from=- 2>/dev/null || true; } | tail -n 1 | cut -f1)
carried=$(du -sb "$DEST" | cut -f1)
total=$((tree + carried))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
echo "carry: $(mib "$total") MiB of $MAX_CARRY_MIB (tree $(mib "$tree"), $DEST $(mib "$carried"))"
if ((total > MAX_CARRY_MIB * 1048576)); then
    echo "ERROR: $(mib "$total") MiB would travel, over MAX_CARRY_MIB=$MAX_CARRY_MIB" >&2
    exit 1
fi
rel=$(realpath --relative-to=. "$DEST")
echo "the card's two calls (device tool; docs/gpu.md): run(command=\"bash scripts/gpu_session.sh" \
     "$rel\", carry=[\"$rel\"], timeout_s=600), then at once run(command=\"PART=2 TOTAL_S=<the" \
     "lease's budget_left_s less 25> bash scripts/gpu_session.sh $rel\", timeout_s=<TOTAL_S + 10>)"
