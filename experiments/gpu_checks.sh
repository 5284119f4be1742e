#!/usr/bin/env bash
# The checks that need a CUDA device, in one go (issue 16; how results/profiles/ is made):
#   1. the executor, compiled-program and profiler tests, the CUDA ones included;
#   2. CPU + GPU profiles of resnet18 b4 and resnet50 b8, op costs timed inside keep-everything
#      steps of the compiled executor (CUDA events, ops back to back) -> results/profiles/;
#   3. executor overhead on CUDA: compiled / interpreted / plain, interleaved, with the
#      keep-everything schedule's predicted step time beside the plain step (--predict);
#   4. run.py on devices=cpu+cuda at 50 % for both nets: XEngine and Checkmate on the GPU alone
#      planned from those profiles and executed (predicted and measured gain);
#   5. (not by default) the schedules planned elsewhere (results/gpu_plan/) side by side.
# Each step has its own time limit and a failed step does not stop the others; after each step
# everything written so far is packed into $OUT/gpu_checks.tar.gz, so a run cut short keeps it.
# Sized for one device call of under 8 minutes on an H200 machine (16 cores).
#
#   bash experiments/gpu_checks.sh [OUT]     (OUT defaults to results/gpu_checks)
#   STEPS="1 3" bash experiments/gpu_checks.sh   (some of the steps only)
set -u
STEPS=" ${STEPS:-1 2 3 4} "
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
log "1. tests (executor, compiled program, profiler; CUDA ones included)"
timeout 120 $PY -m pytest -q -p no:cacheprovider tests/test_executor.py tests/test_program.py \
  tests/test_profile.py -rs 2>&1 | tee "$OUT/pytest.txt" | tail -15
pack
fi

if want 2; then
log "2. profiles (op costs as a step pays them)"
timeout 150 $PY experiments/device_profiles.py --devices cpu cuda --nets resnet18:4 resnet50:8 \
  2>&1 | grep -v -e USDT -e '^\s*$' | tee "$OUT/profiles.txt"
pack
fi

if want 3; then
log "3. executor overhead on the GPU (and the keep-everything prediction)"
timeout 90 $PY experiments/executor_overhead.py --net resnet18 --batch-size 4 --device cuda \
  --predict --rounds 12 2>&1 | grep -v USDT | tee "$OUT/overhead.txt" | tail -4
timeout 60 $PY experiments/executor_overhead.py --net resnet50 --batch-size 8 --device cuda \
  --predict --rounds 10 2>&1 | grep -v USDT | tee -a "$OUT/overhead.txt" | tail -4
pack
fi

if want 4; then
for nb in resnet18:4 resnet50:8; do
  net=${nb%:*}; b=${nb#*:}
  log "4. run.py devices=cpu+cuda $net b$b at 50 %: XEngine against Checkmate on the GPU alone"
  timeout 150 $PY run.py net=$net net.batch_size=$b devices=cpu+cuda mem=50% tracking.enabled=false \
    profile.path=results/profiles/$net-b$b-cpu+cuda.profile.json \
    'strategy=[checkmate,checkpoint_all]' solver.time_limit_s=40 \
    log_level=INFO 2>&1 | grep -v USDT | tee "$OUT/run_cpu_cuda_$net.txt" | tail -25
  pack
done
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
