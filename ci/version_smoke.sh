#!/usr/bin/env bash
# The version smoke pass (issue 29): fuzzshard on one more torch release, beside CI's full suite on the
# pinned 2.13.0. In a venv outside the repo (reused when it already holds that torch):
#   1. a clean session over every target: no new signature expected, and never a contaminated verdict or an
#      internal error (OUT/contaminated/, OUT/internal/ must stay empty: those are fuzzshard's faults);
#   2. the floor check and the version module's tests (tests/test_versions.py: no pool, seconds);
#   3. `fuzzshard known --check` on a sample of the known list (KNOWN_SAMPLE root causes' findings,
#      default 4): a known bug that stops reproducing is printed, not a failure (torch may have fixed it);
#      a run that cannot replay them is.
# usage: ci/version_smoke.sh TORCH_VERSION [OUT_DIR]     e.g. ci/version_smoke.sh 2.14.1
# env:   VENVS (where the venvs live, default ~/.cache/fuzzshard/venvs), EXAMPLES (per target, default 6), KNOWN_SAMPLE (default 4); measured: 223 s on 2.14.1 with the venv already there (42 s of it pip -e), on a loaded 2-core machine
set -euo pipefail
cd "$(dirname "$0")/.."
V=${1:?usage: ci/version_smoke.sh TORCH_VERSION [OUT_DIR]}
OUT=${2:-$(mktemp -d -t "smoke-$V-XXXX")}
mkdir -p "$OUT"
VENV=${VENVS:-$HOME/.cache/fuzzshard/venvs}/torch-$V
EXAMPLES=${EXAMPLES:-6}
t0=$SECONDS
have=$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [ "$have" != "$V" ]; then
  python3 -m venv "$VENV"
  # a release above the machine's pip constraint needs it off; --no-compile: torch's .pyc are not worth a minute
  PIP_CONSTRAINT=/dev/null "$VENV/bin/pip" install -q --no-compile "torch==$V" 'hypothesis>=6.100' numpy pytest pytest-timeout redis
fi
PIP_CONSTRAINT=/dev/null "$VENV/bin/pip" install -q --no-compile --no-deps -e .
echo "smoke torch $V: venv ready in $((SECONDS - t0))s"

"$VENV/bin/fuzzshard" fuzz --target all --max-examples "$EXAMPLES" --world-sizes 1,2 --seed 5 --out "$OUT/fuzz" \
  > "$OUT/fuzz.log" 2>&1 || [ $? -eq 1 ]   # 1: findings (a new torch bug is a success, not a failure)
tail -n 6 "$OUT/fuzz.log"
bad=$( (find "$OUT/fuzz/contaminated" "$OUT/fuzz/internal" -name '*.json' 2>/dev/null || true) | wc -l)
if [ "$bad" -ne 0 ]; then
  echo "smoke torch $V: FAIL: $bad contaminated or internal-error case(s) (fuzzshard's fault, never torch's):"
  find "$OUT/fuzz/contaminated" "$OUT/fuzz/internal" -name '*.json'
  exit 1
fi
echo "smoke torch $V: clean session in $((SECONDS - t0))s: $(find "$OUT/fuzz" -maxdepth 1 -name '*.json' | wc -l) new signature(s)"

"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_versions.py
"$VENV/bin/fuzzshard" known --check --sample "${KNOWN_SAMPLE:-4}" --json "$OUT/known.json" > "$OUT/known.log" 2>&1
tail -n 8 "$OUT/known.log"
echo "smoke torch $V: done in $((SECONDS - t0))s ($OUT)"
