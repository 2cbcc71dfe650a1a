#!/usr/bin/env bash
# The PostgreSQL-side cost of each ledger design, with no Rust in the loop:
# pgbench replays each design's statements (simple protocol, as the layer
# sends them), interleaved A-B-...-B-A so machine noise cancels, and prints
# each design's tps / the bare transaction's tps in the same run.
# The ledger is made by the crate's own migrations (migrations/postgres).
# Usage: [PROTOCOL=simple|prepared] benches/sql/run.sh [clients=8] [seconds=8] [rounds=2] [designs...]
# (prepared: every statement prepared once, variables bound: the floor_*
# scripts, which have no compound statements)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
c="${1:-8}"; t="${2:-8}"; r="${3:-2}"; shift 3 2>/dev/null || shift $#
designs="${*:-bare v5 v6 v6_nosp one_write}"
db=ti_sql_bench
url="${PG_HOST:-127.0.0.1}"
psql -h "$url" -U postgres -qc "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db" >/dev/null
for m in "$here"/../../migrations/postgres/*.sql; do
  psql -h "$url" -U postgres -d $db -q -v ON_ERROR_STOP=1 -f "$m" >/dev/null
done
psql -h "$url" -U postgres -d $db -q -v ON_ERROR_STOP=1 -f "$here/schema.sql" >/dev/null
declare -A sum aborted
for _ in $(seq 1 "$r"); do
  for d in $designs $(echo $designs | tr ' ' '\n' | tac); do
    # A run some client of which aborted (a statement's error: a lock
    # timeout under load, say) counts for nothing; its design is marked.
    if out=$(pgbench -h "$url" -U postgres -n -M "${PROTOCOL:-simple}" -c "$c" -j 2 -T "$t" -f "$here/$d.sql" $db 2>&1); then
      tps=$(echo "$out" | awk '/^tps/ {print $3; exit}')
    else
      aborted[$d]=1
      tps=0
    fi
    sum[$d]=$(awk -v a="${sum[$d]:-0}" -v b="${tps:-0}" 'BEGIN {print a + b}')
  done
done
for d in $designs; do
  if [ -n "${aborted[$d]:-}" ] || [ -n "${aborted[bare]:-}" ]; then
    printf "%-10s clients %2d  a pgbench client aborted (see the server log)  /bare aborted\n" "$d" "$c"
    continue
  fi
  awk -v d="$d" -v x="${sum[$d]}" -v b="${sum[bare]}" -v n=$((2*r)) -v c="$c" \
    'BEGIN { printf "%-10s clients %2d  tps %8.0f  /bare %.2f\n", d, c, x/n, x/b }'
done
psql -h "$url" -U postgres -qc "DROP DATABASE IF EXISTS $db" >/dev/null
