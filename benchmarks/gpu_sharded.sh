#!/usr/bin/env bash
# Sharded strategies on CUDA: the paths a CPU machine cannot run (fp16/bf16 with FSDP2, fairscale FSDP, fairscale
# OSS + ShardedDataParallel over NCCL). Run from the repository root:  bash benchmarks/gpu_sharded.sh
# One process per GPU; with a single GPU everything runs at world size 1 (NCCL cannot put two ranks on one GPU),
# which still exercises mixed precision, loss scaling and the checkpoint formats, but not the sharding itself.
set -uo pipefail  # no -e: a failing run is reported by run() and the others still go
NGPU=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$NGPU" = 0 ]; then  # every run below is a CUDA path: without a GPU each would fail, one after the other
  echo "error: benchmarks/gpu_sharded.sh runs the sharded strategies on CUDA, and torch sees no GPU here" >&2; exit 2
fi
OUT=${OUT:-/tmp/gpu_sharded}
rm -rf "$OUT"
COMMON="--params parameters.yml --set log.progress_bar=false --set log.tensorboard=false --set dist.procs_per_node=$NGPU
        --set train.max_steps=200 --set train.eval_every=100 --set train.save_every=100 --set model.dropout=0"
echo "GPUs: $NGPU"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, fairscale; print('torch', torch.__version__, 'fairscale', fairscale.__version__)"

run() {  # run NAME SETTINGS...: train, then evaluate its best checkpoint in test mode (one process)
  local name=$1; shift
  echo "=== $name: $*"
  mkdir -p "$OUT/$name"
  # Full output to a file; on failure its tail is shown and the next run still goes (one session, one try).
  if python main.py $COMMON --set output_dir="$OUT/$name" "$@" > "$OUT/$name/train.out" 2>&1; then
    grep -E "step 200|dev:" "$OUT/$name/train.out" | tail -3
  else
    echo "FAILED: $name (tail of $OUT/$name/train.out)"; tail -15 "$OUT/$name/train.out"; return
  fi
  python main.py --params "$OUT/$name/config.yml" --set mode=test > "$OUT/$name/test.out" 2>&1 \
    && grep -E "test:" "$OUT/$name/test.out" || { echo "FAILED: $name test mode"; tail -15 "$OUT/$name/test.out"; }
}

# FSDP2 (fully_shard): bf16 (no scaler) and fp16 (ShardedGradScaler); reshard_after_forward both ways.
run fsdp-bf16        --set dist.strategy=fsdp --set train.precision=bf16
run fsdp-fp16        --set dist.strategy=fsdp --set train.precision=fp16
run fsdp-bf16-keep   --set dist.strategy=fsdp --set train.precision=bf16 --set dist.reshard_after_forward=false
run fsdp-fp16-accum  --set dist.strategy=fsdp --set train.precision=fp16 --set train.grad_accum_steps=4 \
                     --set train.clip_grad_norm=1.0
# fairscale FullyShardedDataParallel (CUDA only)
run fsfsdp-fp16      --set dist.strategy=fsdp --set dist.fsdp_impl=fairscale --set train.precision=fp16
run fsfsdp-bf16      --set dist.strategy=fsdp --set dist.fsdp_impl=fairscale --set train.precision=bf16
run fsfsdp-fp32      --set dist.strategy=fsdp --set dist.fsdp_impl=fairscale --set train.clip_grad_norm=1.0
# OSS over NCCL, fp16
run oss-fp16         --set dist.strategy=oss --set train.precision=fp16
run oss-grads-fp16   --set dist.strategy=oss --set dist.shard_grads=true --set train.precision=fp16
run zero-torch-bf16  --set dist.strategy=oss --set dist.oss_impl=torch --set train.precision=bf16

# Resume: continue fsdp-fp16 from step 100 to 200 in a new directory; compare with the uninterrupted run.
python main.py $COMMON --set output_dir="$OUT/fsdp-fp16-resumed" --set dist.strategy=fsdp --set train.precision=fp16 \
  --set train.resume="$OUT/fsdp-fp16/checkpoints/step-100" 2>&1 | grep -E "resumed|step 200|error"
python - "$OUT" <<'PY'
import sys; sys.path.insert(0, ".")
import torch
from core.checkpoint_io import model_state_dict
out = sys.argv[1]
a = model_state_dict(f"{out}/fsdp-fp16/checkpoints/step-200")
b = model_state_dict(f"{out}/fsdp-fp16-resumed/checkpoints/step-200")
print("fsdp fp16 resume: max |diff| =", max((a[k] - b[k]).abs().max().item() for k in a))
PY

