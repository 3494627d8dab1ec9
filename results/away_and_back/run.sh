#!/usr/bin/env bash
# A hospital away for two minutes mid-run, then started again: it rejoins and the run completes.
# Usage: results/away_and_back/run.sh [seconds away, default 120]   (writes output.txt beside this script)
set -euo pipefail
away=${1:-120}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
python -c "from pathlib import Path; from consilium.protocol.identity.roster import local_federation; \
local_federation(Path('$work/fed'), hospitals=3, address='tcp://127.0.0.1:$port')"
fingerprint=$(consilium-roster fingerprint --federation "$work/fed" --name server | sed -n 's/^fingerprint: //p')
party=(--federation "$work/fed" --roster-fingerprint "$fingerprint")
hospital() {  # name, part: a hospital of the federation on its third of the built-in digits
  consilium-hospital "${party[@]}" --name "$1" --data digits --parts 3 --part "$2" >>"$work/$1.log" 2>&1 &
}
consilium-server "${party[@]}" --out "$work/out" --data digits --rounds 6 --expected-batch-size 5 --hidden 8 \
  --round-timeout 10 >"$work/server.log" 2>&1 &
server=$!
hospital hospital-1 1; hospital hospital-2 2; away_pid=$!; hospital hospital-3 3
until grep -q "round    1/6" "$work/server.log"; do sleep 0.2; done
kill -9 "$away_pid"
echo "$(date -u +%T) hospital-2 killed after round 1, away for ${away} s" | tee "$here/output.txt"
sleep "$away"
hospital hospital-2 2
echo "$(date -u +%T) hospital-2 started again" | tee -a "$here/output.txt"
wait "$server"
cat "$work/server.log" | tee -a "$here/output.txt"
python -c "import json; r = json.load(open('$work/out/server_report.json')); \
print('joins:', r['joins']); print('departures:', r['departures'])" | tee -a "$here/output.txt"
jobs -p | xargs -r kill 2>/dev/null || true
