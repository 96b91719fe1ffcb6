#!/usr/bin/env bash
# CI over torch releases (issue 29): .ci/run calls this after the suite on the pinned 2.13.0 has passed. Runs
# ci/version_smoke.sh on each release in FUZZSHARD_CI_VERSIONS, a few lines each, then one closing line
# "N passed, N failed" (and ", N skipped") counting the smoke's checks; exit 1 if any failed.
# FUZZSHARD_CI_VERSIONS: releases, space-separated (default "2.14.1 2.9.1"); "" skips the smoke and prints
#   nothing (so the suite's own closing line stays the last). A release written V:cached runs only when its venv
#   is already in the cache (VENVS, default ~/.cache/fuzzshard/venvs), else one "skip" line says so: building it
#   from nothing downloads GBs (docs/versions.md, "CI over versions"); `ci/version_smoke.sh V` once caches it.
# --venvs: only build (one after another) the torch of each release not cached, not V:cached ones, and print one
#   "venv torch V:" line each: .ci/run starts this in the background before the suite, so a fresh machine's
#   downloads (about 2 minutes a release) overlap the suite; the smoke then waits for each venv on its lock.
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#SBATCH/d;/^#/s/^# \{0,1\}//p;}' "$0"; exit 0 ;; esac  # the comment above
set -uo pipefail
cd "$(dirname "$0")/.."
VERSIONS=${FUZZSHARD_CI_VERSIONS-2.14.1 2.9.1}
[ -n "${VERSIONS// /}" ] || exit 0
if [ "${1:-}" = --venvs ]; then
  for spec in $VERSIONS; do
    [ "${spec%:cached}" = "$spec" ] && SMOKE_TORCH_ONLY=1 ci/version_smoke.sh "$spec"
  done
  exit 0
fi
LOGS=$(mktemp -d -t fuzzshard-versions-XXXX)
t0=$SECONDS
scripted_failures=0
for spec in $VERSIONS; do
  v=${spec%:cached}
  only=0; [ "$v" != "$spec" ] && only=1
  SMOKE_CACHED_ONLY=$only ci/version_smoke.sh "$v" "$LOGS/$v" 2>&1 | tee "$LOGS/$v.lines"
  rc=${PIPESTATUS[0]}
  counted=$(grep -c "^smoke torch $v: FAIL " "$LOGS/$v.lines")
  if [ "$rc" -ne 0 ] && [ "$counted" -eq 0 ]; then  # the script itself broke: a failure all the same
    echo "smoke torch $v: FAIL smoke  ci/version_smoke.sh exited $rc"
    scripted_failures=$((scripted_failures + 1))
  fi
done
passed=$(cat "$LOGS"/*.lines | grep -cE '^smoke torch [^ ]+: ok ')
failed=$(( $(cat "$LOGS"/*.lines | grep -cE '^smoke torch [^ ]+: FAIL ') + scripted_failures ))
skipped=$(cat "$LOGS"/*.lines | grep -cE '^smoke torch [^ ]+: skip ')
echo "version smoke logs: $LOGS"
echo "$passed passed, $failed failed$([ "$skipped" -gt 0 ] && echo ", $skipped skipped") in $((SECONDS - t0))s (version smoke: torch ${VERSIONS})"
[ "$failed" -eq 0 ]
