#!/usr/bin/env bash
# Run DeepSpeed's own unit tests for the hook / recompute paths against the installed DeepSpeed,
# stock and with zerostate.runtime installed into every engine the tests build.
#
#   benchmarks/run_deepspeed_unit_tests.sh [DEEPSPEED_REPO] [MODE] [PYTEST ARGS...]
#
#   DEEPSPEED_REPO  a clone of github.com/deepspeedai/DeepSpeed (default: $DEEPSPEED_REPO, or
#                   /work/.mirror/deepspeedai+DeepSpeed/repo); only its tests/ tree is used.
#   MODE            stock | runtime | both (default both)
#   PYTEST ARGS     default: the two files below; e.g. -k release to run only some tests.
#
# Nothing of DeepSpeed's test code is copied into this project: the script exports tests/ from
# the clone (git archive, at $DEEPSPEED_REV or HEAD) into a scratch folder *without* the repo's
# deepspeed/ package, so the tests import the DeepSpeed installed in the environment (the repo's
# tests/conftest.py puts the repo root first on sys.path).  The runtime is installed through a
# sitecustomize.py on PYTHONPATH (zerostate.runtime.autoinstall, enabled by ZEROSTATE_RUNTIME=1),
# so the processes the tests spawn get it too; ZEROSTATE_RUNTIME_LOG records each install.
#
# On CPU: DS_ACCELERATOR=cpu (gloo).  test_zero_user_backward.py is world-size-2: on CPU its tests
# skip ("not enough GPUs") unless LOCAL_SIZE=2, and then its DDP reference (device_ids=[rank]) fails
# on CPU modules; ZEROSTATE_CPU_DDP=1 adds harness shims (DDP without device_ids for CPU modules; the
# cross-rank "all close" flag gathered on CPU) -- DeepSpeed's test code itself is not changed.
# Example (ZeRO-3 frozen-parameter checkpoint tests, fp32, both modes):
#   LOCAL_SIZE=2 ZEROSTATE_CPU_DDP=1 benchmarks/run_deepspeed_unit_tests.sh "" both \
#     unit/v1/zero/test_zero_user_backward.py -k "Frozen and fp32 and 3"
# Each lifecycle test takes ~35 s on CPU (fresh processes per test).  Results land in
# ${OUT:-zerostate-unit-tests}/<mode>.xml (JUnit) and <mode>.log.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REPO="${1:-}"; REPO="${REPO:-${DEEPSPEED_REPO:-/work/.mirror/deepspeedai+DeepSpeed/repo}}"
MODE="${2:-both}"
shift $(( $# >= 2 ? 2 : $# )) || true
PY="${PYTHON:-$HERE/.venv/bin/python}"
OUT="${OUT:-$HERE/zerostate-unit-tests}"
REV="${DEEPSPEED_REV:-HEAD}"
FILES=(unit/v1/zero/test_zero_activation_checkpoint_lifecycle.py unit/v1/zero/test_zero_user_backward.py)
ARGS=("$@")
[ ${#ARGS[@]} -eq 0 ] && ARGS=("${FILES[@]}")

GITDIR="$REPO"; [ -d "$REPO/.git" ] || [ -f "$REPO/HEAD" ] || { echo "no git repository at $REPO" >&2; exit 2; }
mkdir -p "$OUT"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/zs-dsunit-XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
{ git -C "$GITDIR" archive "$REV" tests 2>/dev/null || true; } | tar -x -C "$WORK"
COMMIT="$(git -C "$GITDIR" rev-parse "$REV")"
mkdir -p "$WORK/site"
cat > "$WORK/site/sitecustomize.py" <<'EOF'
import os
if os.environ.get("ZEROSTATE_RUNTIME") == "1":
    from zerostate.runtime.autoinstall import enable
    enable()
if os.environ.get("ZEROSTATE_CPU_DDP") == "1":
    # test_zero_user_backward.py builds its PyTorch reference as DDP(model, device_ids=[rank]),
    # which torch rejects for CPU modules; on CPU drop device_ids / output_device (harness shim).
    import torch.nn.parallel as _par
    _init = _par.DistributedDataParallel.__init__
    def _cpu_init(self, module, *a, **kw):
        if not any(p.is_cuda for p in module.parameters()):
            kw.pop("device_ids", None); kw.pop("output_device", None)
            a = ()
        _init(self, module, *a, **kw)
    _par.DistributedDataParallel.__init__ = _cpu_init
    # unit.common.reduce_boolean_flags builds its flag tensor on get_accelerator().current_device(),
    # an int on the CPU accelerator (read by torch as a CUDA index): gather the flags on CPU instead.
    import importlib.abc, importlib.util, sys

    def _cpu_reduce_boolean_flags(flag, op=all):
        import torch, torch.distributed as tdist
        if not tdist.is_initialized():
            return flag
        mine = torch.tensor([1 if flag else 0], dtype=torch.int)
        every = [torch.zeros(1, dtype=torch.int) for _ in range(tdist.get_world_size())]
        tdist.all_gather(every, mine)
        return op(bool(t.item()) for t in every)

    class _PatchUnitCommon(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "unit.common":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                module.reduce_boolean_flags = _cpu_reduce_boolean_flags
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _PatchUnitCommon())
EOF

export DS_ACCELERATOR=cpu OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONWARNINGS=ignore
echo "DeepSpeed tests from $REPO @ $COMMIT; installed DeepSpeed $("$PY" -c 'import deepspeed; print(deepspeed.__version__)' 2>/dev/null)"

run() {  # run <mode>
  local mode="$1" log="$OUT/$1.log" xml="$OUT/$1.xml" installs="$OUT/$1.installs"
  rm -f "$installs"
  local env_extra=()
  if [ "$mode" = runtime ]; then
    env_extra=(ZEROSTATE_RUNTIME=1 ZEROSTATE_RUNTIME_LOG="$installs")
  fi
  echo "== $mode"
  ( cd "$WORK/tests" && env "${env_extra[@]}" PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}" \
      "$PY" -m pytest -p no:cacheprovider -q -rA --junitxml="$xml" "${ARGS[@]}" ) >"$log" 2>&1 || true
  grep -E "^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)|passed|failed" "$log" | tail -n 40
  if [ "$mode" = runtime ]; then
    echo "engines with zerostate.runtime installed: $(wc -l < "$installs" 2>/dev/null || echo 0)"
  fi
}

case "$MODE" in
  stock) run stock ;;
  runtime) run runtime ;;
  both) run stock; run runtime ;;
  *) echo "MODE must be stock, runtime or both" >&2; exit 2 ;;
esac
