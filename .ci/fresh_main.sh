#!/usr/bin/env bash
# The README's first command as a new user runs it: the repository's files in a fresh directory, a fresh
# venv (python3 -m venv, pip, the core install only: no [test] extra, so no torch), an empty HOME (no
# ~/.cache: the model alias is built from scratch, no pip cache). Passes only if the command exits 0
# and its last stdout line is JSON with non-empty token_ids. Takes several minutes (downloads).
#
# Usage: bash .ci/fresh_main.sh        (from anywhere; exit status = the check's)
# The files copied are git's tracked and untracked-but-not-ignored ones: in CI's clean checkout exactly a
# fresh clone; locally, uncommitted edits are tried too.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$SECONDS

mkdir "$work/repo" "$work/home"
(cd "$root" && git ls-files -z --cached --others --exclude-standard |
    while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done |
    tar --null -T - -cf -) | tar -xf - -C "$work/repo"

cmd=$(awk '/^```bash/{f=1;next} /^```/{if(f){exit}} f' "$work/repo/README.md" | head -1)
[ -n "$cmd" ] || { echo "fresh_main: no bash command in README.md" >&2; exit 1; }
python3 -m venv "$work/venv"
echo "fresh_main: running in a fresh venv with HOME=$work/home: $cmd" >&2

# Only what a new user's shell would have: the venv first on PATH, no project caches or import paths.
set +e
(cd "$work/repo" && env -u DSPINE_JAX_CACHE -u PYTHONPATH -u XDG_CACHE_HOME -u VIRTUAL_ENV \
    HOME="$work/home" PATH="$work/venv/bin:$PATH" bash -c "$cmd") >"$work/out" 2>"$work/err"
rc=$?
set -e
echo "fresh_main: exit $rc after $((SECONDS - start)) s; venv $(du -sh "$work/venv" | cut -f1)" \
    "($("$work/venv/bin/python" -m pip list --disable-pip-version-check 2>/dev/null | tail -n +3 | wc -l) packages)" >&2
if [ $rc -ne 0 ]; then
    echo "fresh_main: the command failed; last stderr lines:" >&2
    tail -20 "$work/err" >&2
    exit 1
fi
if "$work/venv/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; then
    echo "fresh_main: torch got installed by the core install (it should need none)" >&2
    exit 1
fi
"$work/venv/bin/python" - "$work/out" <<'EOF'
import json
import sys

lines = open(sys.argv[1], encoding="utf-8").read().strip().splitlines()
try:
    record = json.loads(lines[-1])
except (IndexError, json.JSONDecodeError):
    sys.exit(f"fresh_main: the last stdout line is not JSON: {lines[-1:]}")
if not isinstance(record, dict) or not record.get("token_ids"):
    sys.exit(f"fresh_main: no token_ids in {lines[-1][:300]}")
print(f"fresh_main: ok: {len(record['token_ids'])} tokens, {record.get('tokens_per_second')} tok/s "
      f"(compilation {record.get('compile_seconds')} s apart): {record.get('text', '')[:80]!r}", file=sys.stderr)
EOF
echo "fresh_main: passed in $((SECONDS - start)) s" >&2
