#!/usr/bin/env bash
# The checks that need a CUDA device, in one go (how results/profiles/ was made):
#   1. the executor and profiler tests, the CUDA ones included (they skip without a GPU);
#   2. measured CPU + GPU profiles of the benchmark nets -> results/profiles/;
#   3. run.py on devices=cpu+cuda with the resnet18 profile: every schedule executed;
#   4. the executor's overhead against a plain PyTorch step on the GPU;
#   5. the schedules planned elsewhere from those profiles (results/gpu_plan/<net>_b<B>/,
#      made with run.py ... execute=false) run side by side with plain steps.
# Each step has its own time limit and a failed step does not stop the others; after each step
# everything written so far is packed into $OUT/gpu_checks.tar.gz, so a run cut short keeps it.
#
#   bash experiments/gpu_checks.sh [OUT]     (OUT defaults to results/gpu_checks)
#   STEPS="1 3" bash experiments/gpu_checks.sh   (some of the steps only)
set -u
STEPS=" ${STEPS:-1 2 3 4 5} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
OUT=${1:-${OUT:-results/gpu_checks}}
mkdir -p "$OUT" results/profiles
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
log() { echo "== $(date -u +%H:%M:%S) $*"; }
pack() { tar czf "$OUT/gpu_checks.tar.gz" results/profiles results/executor_overhead \
  results/execute_schedules results/runs "$OUT"/*.txt 2>/dev/null; }

log "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
$PY -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision",
torchvision.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0),
"cpu threads", torch.get_num_threads())'

if want 1; then
log "1. tests (executor and profiler; CUDA ones included)"
timeout 150 $PY -m pytest -q -p no:cacheprovider tests/test_executor.py tests/test_profile.py \
  -rs 2>&1 | tee "$OUT/pytest.txt" | tail -15
pack
fi

if want 2; then
log "2. profiles"
timeout 240 $PY experiments/device_profiles.py --devices cpu cuda \
  --nets resnet18:4 resnet18:8 vgg16:8 mobilenet_v2:8 resnet50:8 2>&1 |
  grep -v -e USDT -e '^\s*$' | tee "$OUT/profiles.txt"
pack
fi

if want 3; then
log "3. run.py devices=cpu+cuda (resnet18 b4, 50 % of keep-everything on each device)"
timeout 200 $PY run.py devices=cpu+cuda mem=50% tracking.enabled=false \
  profile.path=results/profiles/resnet18-b4-cpu+cuda.profile.json \
  'strategy=[checkmate,checkpoint_all,chen_greedy]' solver.time_limit_s=45 \
  log_level=INFO 2>&1 | grep -v USDT | tee "$OUT/run_cpu_cuda.txt" | tail -40
pack
fi

if want 4; then
log "4. executor overhead on the GPU"
timeout 60 $PY experiments/executor_overhead.py --device cuda --steps 10 2>&1 |
  grep -v USDT | tee "$OUT/overhead.txt" | tail -3
pack
fi

if want 5; then
log "5. planned schedules executed side by side"
for plan in results/gpu_plan/*_b*/; do
  tag=$(basename "$plan"); net=${tag%_b*}; batch=${tag##*_b}
  timeout 150 $PY experiments/execute_schedules.py --net "$net" --batch-size "$batch" \
    --profile "results/profiles/$net-b$batch-cpu+cuda.profile.json" --rounds 20 --tag "$tag" \
    --schedule "xengine=$plan/xengine.json" --schedule "checkmate.cuda=$plan/checkmate.cuda.json" \
    2>&1 | grep -v -e USDT -e Warning -e _warn_once | tee -a "$OUT/planned.txt" | tail -4
done
pack
fi
log "done"
