#!/usr/bin/env bash
# Instructions per request in the service (its connection tasks: the
# layer, the handler, sqlx's side of each statement; and v8's claim, a
# task of its own), counted by valgrind's callgrind: a figure that does
# not depend on machine noise, for comparing
# routes (or two builds of one route) where throughput cannot tell a few
# per cent apart. Counts weigh every instruction alike (a memcpy of a
# large future counts per byte moved; SHA-256 runs without the CPU's SHA
# extensions under valgrind): compare routes with it, not seconds.
# Usage: benches/instructions.sh [routes...]   (default: bare one commit two layer)
# Needs valgrind and the load bench built (cargo bench --bench load --no-run);
# N=300 sequential requests per route (first uses, such as preparing each
# statement, are spread over them), BIN overrides the bench binary.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="${BIN:-$(ls -t "$here"/../target/release/deps/load-* | grep -v '\.d$' | head -1)}"
n="${N:-300}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
for route in ${*:-bare one commit two layer}; do
  TI_BENCH_SEQUENTIAL=$n TI_BENCH_PROFILE=$route valgrind --tool=callgrind \
    --collect-atstart=no '--toggle-collect=*handle_connection*' \
    '--toggle-collect=*store::task::claim_task*' \
    --callgrind-out-file="$out/$route" "$bin" --bench > "$out/$route.log" 2>&1 ||
    { cat "$out/$route.log"; exit 1; }
  ir=$(awk '/refs:/ {gsub(",", "", $4); print $4}' "$out/$route.log")
  printf "%-8s %8d instructions per request\n" "$route" $((ir / n))
done
