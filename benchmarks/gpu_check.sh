#!/usr/bin/env bash
# GPU readiness check: the script to run when a GPU node is available; one call, under 10 minutes.
#
#   benchmarks/gpu_check.sh [--dry-run] [OUTDIR]
#
# Runs, on CUDA, in an environment that already has a CUDA build of torch, DeepSpeed 0.19.8 and
# zerostate's `test` extra (`pip install -e '.[test]'`; nothing is downloaded here: HF_HUB_OFFLINE=1):
#   1. env.json           -- torch / DeepSpeed / transformers versions, the GPUs;
#   2. pytest-*.log/.xml  -- the real-DeepSpeed tests at world size 1, a targeted subset (the deepspeed
#                            target's exact scenarios, known issues and tracer; the runtime's install tests);
#   3. pytest-ranks       -- with 2 or more GPUs: the world-size-2 tests on NCCL, one GPU per rank (the
#                            rank pool picks CUDA when there are as many GPUs as ranks): ranks agree with
#                            each other and the oracle, the cross-rank checks, a hang with stacks;
#   4. explore/           -- a short exploration of the installed DeepSpeed at world size 1 (`zerostate
#                            explore`); explore-wsN/ -- the same at world size N, the largest of 2, 4, 8
#                            the GPUs allow (NCCL);
#   5. hf_fp32.json, hf_bf16.json -- the Hugging Face job (tiny Llama + LoRA + gradient checkpointing,
#                            HF Trainer, ZeRO-3 at DeepSpeed's defaults and at persistence threshold 0)
#                            stock vs runtime: s/step, frozen gathers per backward, peak gathered frozen
#                            elements, whether the losses match (benchmarks/bench_hf_runtime.py);
#   6. summary.txt        -- every step's exit status and time, the HF tables, and "verified:" -- what the
#                            steps that passed have shown.
# OUTDIR defaults to $OUT (the device machine's result folder) or ./zerostate-gpu-check.
#
# Without a CUDA GPU (torch.cuda.is_available() false) it stops after step 1 with exit 2 and one line saying
# nothing was verified.  --dry-run: the same steps on CPU (DS_ACCELERATOR=cpu, gloo; world size 2 as if two
# GPUs were there), smaller budgets, so the script itself is exercised where no GPU is lent.  A step that fails
# is recorded and the next one still runs; the exit status is the number of failed steps (0: all passed).
set -u

DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUTDIR="${1:-${OUT:-zerostate-gpu-check}}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$HERE"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
mkdir -p "$OUTDIR"
SUMMARY="$OUTDIR/summary.txt"
: > "$SUMMARY"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONWARNINGS=ignore CI=true
FAILED=0
PASSED=""

if [ "$DRY" = 1 ]; then
  export DS_ACCELERATOR=cpu
  DEVICE=cpu; HF_STEPS=4; EXPLORE_BUDGET=20; EXPLORE_EXAMPLES=5; T_PYTEST=300; T_HF=900; T_EXPLORE=420
  WS_EXAMPLES=2
  HF_CONFIGS="default"
  DEADLINE=0  # no overall cap on CPU (a shared 2-core machine takes far longer than a GPU node)
  TARGET_K="correct_release_agrees and seed-002"
  INSTALL_K="selfcheck_installed and seed002-engine or patched_initialize and z3-bf16"
else
  DEVICE=cuda; HF_STEPS=8; EXPLORE_BUDGET=45; EXPLORE_EXAMPLES=20; T_PYTEST=150; T_HF=120; T_EXPLORE=150
  WS_EXAMPLES=6
  HF_CONFIGS="default persist0"
  DEADLINE=570  # seconds: every step's limit is cut to what is left of this, so the whole call stays < 10 min
  TARGET_K="correct_release_agrees or known_issue or tracer"
  INSTALL_K="selfcheck_installed or patched_initialize"
fi

step() {  # step NAME TIMEOUT CMD...: run, time, record
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS rc
  if [ "$DEADLINE" -gt 0 ]; then
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -lt 20 ]; then
      echo "== $name: skipped, the 8-minute budget is spent" | tee -a "$SUMMARY"; FAILED=$((FAILED + 1)); return 0
    fi
    if [ "$limit" -gt "$left" ]; then limit=$left; fi
  fi
  echo "== $name: $*" | tee -a "$SUMMARY"
  timeout --kill-after=10 "$limit" "$@" > "$OUTDIR/$name.log" 2>&1
  rc=$?
  case "$name" in explore*)
    if [ "$rc" = 1 ]; then  # `zerostate explore` exits 1 when it reports findings
      echo "== $name: findings reported (exit 1): see $OUTDIR/$name/report.md" | tee -a "$SUMMARY"; rc=0
    fi;;
  esac
  echo "== $name: exit $rc, $((SECONDS - t0)) s" | tee -a "$SUMMARY"
  if [ "$rc" != 0 ]; then FAILED=$((FAILED + 1)); tail -n 20 "$OUTDIR/$name.log" | sed 's/^/   | /' >> "$SUMMARY"
  else PASSED="$PASSED $name"; fi
  return 0
}

verified() {  # what a step that passed has shown
  case "$1" in
    env) echo "  env: torch and DeepSpeed import; device $DEVICE, $NGPU GPU(s) (env.json)";;
    pytest-target) echo "  pytest-target: the deepspeed target's exact scenarios agree with the oracle, known issues" \
                        "and the tracer, at world size 1 on $DEVICE";;
    pytest-runtime) echo "  pytest-runtime: the runtime's install tests (selfcheck, patched initialize) on $DEVICE";;
    pytest-ranks) echo "  pytest-ranks: world size 2 on $RANKS_BACKEND: ranks agree with each other and the oracle," \
                       "cross-rank checks, a hang reported with stacks";;
    explore) echo "  explore: zerostate explore at world size 1 ran to its end ($OUTDIR/explore/report.md)";;
    explore-ws*) echo "  $1: zerostate explore at world size ${1#explore-ws} on $RANKS_BACKEND ran to its end" \
                      "($OUTDIR/$1/report.md)";;
    hf-*) echo "  $1: the HF job, stock vs runtime, on $DEVICE ($OUTDIR/hf_${1#hf-}.json)";;
  esac
}

# 1. environment (fails the check when CUDA is wanted but absent)
step env 120 "$PY" - "$OUTDIR/env.json" "$DEVICE" <<'EOF'
import json, sys
import torch, deepspeed
info = {"torch": torch.__version__, "deepspeed": deepspeed.__version__, "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(), "device_wanted": sys.argv[2],
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "bf16_supported": torch.cuda.is_available() and torch.cuda.is_bf16_supported()}
try:
    import transformers, peft, accelerate
    info.update(transformers=transformers.__version__, peft=peft.__version__, accelerate=accelerate.__version__)
except ImportError as e:
    info["hf_missing"] = str(e)
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(json.dumps(info))
sys.exit(0 if sys.argv[2] == "cpu" or info["cuda_available"] else 1)
EOF

NGPU=$("$PY" -c "import json,sys; print(len(json.load(open(sys.argv[1])).get('gpus') or []))" "$OUTDIR/env.json" \
  2>/dev/null || echo 0)
if [ "$DRY" = 0 ] && [ "$NGPU" -lt 1 ]; then
  echo "gpu_check: no CUDA GPU here (torch.cuda.is_available() is false, see $OUTDIR/env.log): nothing verified;" \
       "run it on a GPU node, or with --dry-run to exercise the script on CPU" | tee -a "$SUMMARY" >&2
  exit 2
fi
if [ "$DRY" = 1 ]; then WS=2; RANKS_BACKEND="gloo (CPU)"
else
  WS=1; for n in 2 4 8; do if [ "$NGPU" -ge "$n" ]; then WS=$n; fi; done
  RANKS_BACKEND="NCCL ($WS GPUs)"
fi

# 2. the real-DeepSpeed tests, a targeted subset (each file in its own pytest process: one process group each)
step pytest-target "$T_PYTEST" "$PY" -m pytest -q -p no:cacheprovider generated_tests/test_deepspeed_target.py \
  -k "$TARGET_K" --junitxml="$OUTDIR/pytest-target.xml"
step pytest-runtime "$T_PYTEST" "$PY" -m pytest -q -p no:cacheprovider generated_tests/test_runtime_install.py \
  -k "$INSTALL_K" --junitxml="$OUTDIR/pytest-runtime.xml"

# 3. several ranks, one GPU each (NCCL); on --dry-run two CPU ranks (gloo)
if [ "$WS" -ge 2 ]; then
  step pytest-ranks "$T_PYTEST" "$PY" -m pytest -q -p no:cacheprovider generated_tests/test_deepspeed_world2.py \
    -k "ranks_agree or cross_rank_checks_detect or never_arrives" --junitxml="$OUTDIR/pytest-ranks.xml"
else
  echo "== pytest-ranks, explore-ws: not run, one GPU only (world size 2+ needs a GPU per rank)" | tee -a "$SUMMARY"
fi

# 4. short explorations of the installed DeepSpeed: world size 1, then the most ranks the GPUs allow
step explore "$T_EXPLORE" "$PY" -m zerostate.cli.main explore --time-budget "$EXPLORE_BUDGET" \
  --examples "$EXPLORE_EXAMPLES" --out "$OUTDIR/explore"
if [ "$WS" -ge 2 ]; then
  step "explore-ws$WS" "$T_EXPLORE" "$PY" -m zerostate.cli.main explore --world-size "$WS" \
    --time-budget "$EXPLORE_BUDGET" --examples "$WS_EXAMPLES" --out "$OUTDIR/explore-ws$WS"
fi

# 5. the HF job on the device, fp32 and bf16, stock vs runtime
for DT in fp32 bf16; do
  step "hf-$DT" "$T_HF" "$PY" benchmarks/bench_hf_runtime.py --device "$DEVICE" --dtype "$DT" --steps "$HF_STEPS" \
    --warmup 2 --rounds 1 --configs $HF_CONFIGS --json "$OUTDIR/hf_$DT.json"
  sed -n '/^HF job/,/^written/p' "$OUTDIR/hf-$DT.log" >> "$SUMMARY"
done

{
  echo "verified:"
  for name in $PASSED; do verified "$name"; done
  echo "failed steps: $FAILED (figures in $OUTDIR)"
} | tee -a "$SUMMARY"
exit "$FAILED"
