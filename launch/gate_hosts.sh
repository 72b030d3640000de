#!/usr/bin/env bash
# Host discovery behind a gate, for elastic Horovod: the lines DISCOVERY prints ("host:slots"),
# except that a host it did not print at the job's start, nor the last time, is listed only
# once a worker can start there: `PYTHON -c 'import horovod.torch, hvd_lm.cli'` over ssh (on
# this machine for its own names), checked in the background while the job runs on. Why:
# Horovod 0.28.1 starts a returning host's worker only after the running workers have entered
# the new rendezvous, and one that fails to start (no venv there, an import error, ssh refused)
# makes every worker abort and the whole job end ("failure count == N -> stop running"),
# whatever the Gloo timeout (docs/reliability.md "Elastic: a host that comes back"). A failed
# check is tried again after GATE_RETRY_S seconds; each check's outcome is a line of
# STATE_DIR/gate.log. Horovod runs the discovery script every second: this one never waits.
#
# Usage: gate_hosts.sh STATE_DIR PYTHON DISCOVERY [ARGS...]   (launch/lib.sh hvd_lm_gate_discovery
# writes the one-line script horovodrun runs; STATE_DIR is emptied when a job starts)
set -uo pipefail
state="$1" python="$2"
shift 2
retry_s="${GATE_RETRY_S:-30}"
mkdir -p "$state"
lines="$("$@")" || exit $?
first=0
[ -f "$state/listed" ] || first=1      # the job's start: its hosts were checked by the preflight
now="$(date +%s)"

check() {  # host: can a worker start there? (the ssh options horovodrun's own)
  local cmd
  cmd="$(printf '%q' "$python") -c 'import horovod.torch, hvd_lm.cli'"
  case "$1" in
    localhost | 127.0.0.1 | "$(hostname)" | "$(hostname -f 2>/dev/null)")
      timeout 300 bash -c "$cmd" ;;
    *) timeout 300 ssh -o PasswordAuthentication=no -o StrictHostKeyChecking=no \
         -o ConnectTimeout=10 "$1" "$cmd" ;;
  esac
}

listed=""
while IFS= read -r line; do
  [ -n "$line" ] || continue
  host="${line%%:*}"
  if [ "$first" = 1 ] || [ -f "$state/ok.$host" ] \
      || grep -qxF -- "$host" "$state/listed" 2>/dev/null; then
    echo "$line"
    listed+="$host"$'\n'
    continue
  fi
  [ -e "$state/checking.$host" ] && continue
  if [ -f "$state/failed.$host" ] && [ $((now - $(cat "$state/failed.$host"))) -lt "$retry_s" ]; then
    continue
  fi
  touch "$state/checking.$host"
  (  # in the background, its output away from horovodrun's read of this script's
    if check "$host"; then
      touch "$state/ok.$host"
      echo "$(date -Is) $host: a worker can start there: listed" >> "$state/gate.log"
    else
      date +%s > "$state/failed.$host"
      echo "$(date -Is) $host: returned, but a worker cannot start there (ssh or" \
        "'$python -c import horovod.torch, hvd_lm.cli' failed): not listed, tried again in" \
        "${retry_s} s" >> "$state/gate.log"
    fi
    rm -f "$state/checking.$host"
  ) </dev/null >/dev/null 2>&1 &
done <<< "$lines"
for f in "$state"/ok.*; do     # a host gone again is checked again when it returns
  [ -e "$f" ] || continue
  grep -qxF -- "${f##*/ok.}" <<< "$listed" || rm -f "$f"
done
printf '%s' "$listed" > "$state/listed.tmp" && mv "$state/listed.tmp" "$state/listed"
