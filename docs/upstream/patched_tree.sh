#!/usr/bin/env bash
# Make a DeepSpeed 0.19.8 source tree with one or more of these patches applied, shaped like a git
# checkout (no git_version_info_installed.py: DeepSpeed reads version.txt at the tree's root), for
#   zerostate diff --base 0.19.8 --head DEST
#   ZEROSTATE_PATCHED_DEEPSPEED=DEST pytest generated_tests/test_cli_diff.py -k docs_upstream
#
#   docs/upstream/patched_tree.sh DEST ID [ID...]     e.g.  ... /tmp/ds-fix z3-leaf-kept-gathered
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DEST="$1"; shift
[ $# -ge 1 ] || { echo "usage: $0 DEST ID [ID...]  (IDs: folders of $HERE)" >&2; exit 2; }
PY="${PYTHON:-$HERE/../../.venv/bin/python}"
[ -e "$DEST" ] && { echo "$DEST exists" >&2; exit 2; }
TMP="$(mktemp -d)"; trap 'rm -rf "$TMP"' EXIT
"$PY" -m pip download --quiet --no-deps --no-binary :all: deepspeed==0.19.8 -d "$TMP"
tar -xzf "$TMP"/deepspeed-0.19.8.tar.gz -C "$TMP"
mv "$TMP/deepspeed-0.19.8" "$DEST"
rm -rf "$DEST/deepspeed/git_version_info_installed.py" "$DEST/deepspeed.egg-info"
for id in "$@"; do
  patch -d "$DEST" -p1 --quiet < "$HERE/$id/fix.patch"
  echo "applied $id"
done
echo "$DEST: DeepSpeed $(cat "$DEST/version.txt") + $*"
