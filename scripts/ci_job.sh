#!/usr/bin/env bash
# ci_job.sh NAME SECONDS COMMAND...: run COMMAND for at most SECONDS (.ci/run: what is left of its limit). Past it,
# stop it (its whole process group) and name the tests running then, from the file tests/_running.py keeps
# ($RLHF_ENGINE_TEST_RUNNING_FILE); exit 124. Otherwise exit as COMMAND did.
set -uo pipefail
name=$1 left=$2
shift 2
root=$(cd "$(dirname "$0")/.." && pwd)
if [ "$left" -le 0 ]; then
  echo "CI: no time was left for the ${name}" >&2
  exit 124
fi
timeout --kill-after=30 "$left" "$@"
rc=$?
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
  echo "CI: stopped the ${name} after ${left} s, at the time limit; the tests running then:" >&2
  python3 "$root/tests/_running.py" "${RLHF_ENGINE_TEST_RUNNING_FILE:-}" >&2
  exit 124
fi
exit "$rc"
