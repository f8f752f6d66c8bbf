#!/usr/bin/env bash
# mypy over zerostate's packages: strict on the pure core (model, specs, analysis), the findings and the worker
# protocol (what crosses a process boundary) and the reports, a plain pass on the rest.
#
# The import packages are mapped from top-level folders (pyproject's [tool.setuptools] package-dir) and installed
# editable through an import hook mypy cannot follow, so this builds the package tree mypy expects as symlinks
# under .typecheck/ (read from package-dir, so a new package is picked up) and points MYPYPATH at it.
#
# usage: tools/typecheck.sh [strict|rest|all]     (default all; exit 1 if a chosen pass reports errors)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
WHICH=${1:-all}
STRICT_PKGS=(zerostate.model zerostate.specs zerostate.analysis zerostate.findings zerostate.reports zerostate.doctor)
STRICT_MODS=(zerostate.harness.protocol)

layout=$("$PY" - "${STRICT_PKGS[@]}" <<'PYEOF'
import os, sys, tomllib

strict = set(sys.argv[1:])
with open("pyproject.toml", "rb") as fh:
    dirs = tomllib.load(fh)["tool"]["setuptools"]["package-dir"]
root = ".typecheck"
top = os.path.join(root, "zerostate")
os.makedirs(top, exist_ok=True)


def link(target: str, at: str) -> None:
    """Make ``at`` a symlink to ``target`` (relative), leaving a correct one alone (another run may be reading)."""
    rel = os.path.relpath(target, os.path.dirname(at))
    if os.path.islink(at) and os.readlink(at) == rel:
        return
    if os.path.lexists(at):
        os.remove(at)
    os.symlink(rel, at)


wanted = set()
# The top package's own files are linked one by one: its folder cannot be linked whole, since the
# mapped sub-packages live elsewhere and must appear inside it.
for name in os.listdir(dirs["zerostate"]):
    if name.endswith(".py"):
        wanted.add(name)
        link(os.path.join(dirs["zerostate"], name), os.path.join(top, name))
for pkg in sorted(dirs, key=lambda p: p.count(".")):
    if pkg == "zerostate":
        continue
    parent, leaf = pkg.rsplit(".", 1)
    at = os.path.join(root, *pkg.split("."))
    if parent != "zerostate":  # reached through its parent's link (targets/deepspeed)
        if os.path.realpath(at) != os.path.realpath(dirs[pkg]):
            sys.exit(f"typecheck: {pkg} maps to {dirs[pkg]}, but {dirs[parent]}/{leaf} is not that folder")
        continue
    wanted.add(leaf)
    link(dirs[pkg], at)
for name in set(os.listdir(top)) - wanted:  # a package or file that is gone
    if os.path.islink(os.path.join(top, name)):
        os.remove(os.path.join(top, name))
top_level = [p for p in dirs if p.count(".") == 1]
print(" ".join(p for p in top_level if p not in strict))
# sed expressions that turn .typecheck/zerostate/<pkg>/ back into the package's folder in mypy's messages
print(" ".join(f"s#^{root}/zerostate/{p.split('.')[1]}/#{dirs[p]}/#;" for p in top_level)
      + f" s#^{root}/zerostate/#{dirs['zerostate']}/#")
PYEOF
)
REST_PKGS=(${layout%%$'\n'*})
PATHS=${layout#*$'\n'}

export MYPYPATH=$PWD/.typecheck
MYPY=("$PY" -m mypy --cache-dir .typecheck/.mypy_cache)
args() { for p in "$@"; do printf -- '-p\n%s\n' "$p"; done; }
status=0

if [[ $WHICH == strict || $WHICH == all ]]; then
    echo "== mypy --strict: ${STRICT_PKGS[*]} ${STRICT_MODS[*]}"
    mapfile -t a < <(args "${STRICT_PKGS[@]}"; for m in "${STRICT_MODS[@]}"; do printf -- '-m\n%s\n' "$m"; done)
    # Modules outside these are not checked here (skip); only zerostate/__init__.py's lazy imports reach
    # them.  Stub files (networkx's) are still followed.
    "${MYPY[@]}" --strict --follow-imports=skip "${a[@]}" 2>&1 | sed -E "$PATHS" || status=1
fi
if [[ $WHICH == rest || $WHICH == all ]]; then
    echo "== mypy (not strict, --ignore-missing-imports): zerostate ${REST_PKGS[*]}"
    mapfile -t a < <(args "${REST_PKGS[@]}")
    # silent: modules imported from outside these packages (the strict ones) are analysed, not reported
    out=$("${MYPY[@]}" --ignore-missing-imports --no-check-untyped-defs --follow-imports=silent \
          -m zerostate "${a[@]}" 2>&1 | sed -E "$PATHS") || status=1
    printf '%s\n' "$out"
    echo "-- errors per package (folder):"
    printf '%s\n' "$out" | grep -E '^[^ :]+\.py:[0-9]+: error:' | cut -d/ -f1 | sort | uniq -c | sort -rn || echo "   none"
fi
exit $status
