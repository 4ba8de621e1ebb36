#!/usr/bin/env bash
# Everything a borrowed GPU machine should run, in one call of under 9 minutes, from the repository root:
#     bash benchmarks/gpu_session.sh                 # logs under $OUT/gpu_session (or /tmp/gpu_session)
#     WHEELS=wheels bash benchmarks/gpu_session.sh   # first install missing packages from carried wheels
#     BUDGET_S=300 bash benchmarks/gpu_session.sh    # a shorter overall deadline (default 530 s)
# Stages (each cut off by its own time limit and the overall deadline, so one hang cannot eat the session):
#   1. which Python packages are missing (torch with CUDA is assumed to be there; nothing is downloaded)
#   2. tests/test_gpu.py: AMP, NCCL, FSDP2 and fairscale FSDP on CUDA, fairscale checkpoint -> resume -> test
#   3. benchmarks/gpu_sharded.sh: 200-step runs of every sharded strategy in fp16/bf16 + test mode + resume
#   4. benchmarks/bench_bert_mfu.py: BERT-base bf16 sequences/s and MFU, our Trainer vs transformers.Trainer
#   5. benchmarks/bench_trainer_overhead.py on CUDA; then, with time left, the MFU run reading HDF5 row by row
set -uo pipefail  # no -e: a failing stage is reported and the next one still runs
cd "$(dirname "$0")/.."
LOG=${OUT:-/tmp}/gpu_session
mkdir -p "$LOG"
DEADLINE=$((SECONDS + ${BUDGET_S:-530}))  # 8 min 50 s by default
export PYTHONUNBUFFERED=1
SUMMARY=()

stage() {  # stage NAME LIMIT_S COMMAND...: run with a time limit, output to the screen and $LOG/NAME.log
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - SECONDS - 15))  # timeout's --kill-after may add 10 s
  ((limit > left)) && limit=$left
  if ((limit < 20)); then SUMMARY+=("$name: skipped (out of time)"); echo "=== $name: skipped, out of time"; return; fi
  echo "=== [$(date +%T), ${SECONDS}s] $name (limit ${limit}s): $*"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$LOG/$name.log"
  local rc=${PIPESTATUS[0]}
  SUMMARY+=("$name: rc $rc$( ((rc == 124)) && echo ' (timed out)'), $((SECONDS - start)) s, log $LOG/$name.log")
}

# ---- 1. environment ------------------------------------------------------------------------------------------
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi failed"
python -c "import torch as t; print('torch', t.__version__, 'cuda', t.version.cuda, 'GPUs', t.cuda.device_count())"
missing_packages() {  # package names of the modules that do not import
  python - <<'PY'
import importlib
names = {"yaml": "pyyaml", "sklearn": "scikit-learn"}  # import name -> package name, where they differ
for m in ["transformers", "fairscale", "h5py", "yaml", "sklearn", "tensorboard", "tqdm", "pytest", "accelerate"]:
    try:
        importlib.import_module(m)
    except ImportError:
        print(names.get(m, m))
PY
}
missing=$(missing_packages)
if [[ -n "$missing" && -n "${WHEELS:-}" ]]; then
  echo "installing from $WHEELS:" $missing
  python -m pip install -q --no-index --find-links "$WHEELS" $missing 2>&1 | tail -3
  missing=$(missing_packages)
fi
echo "missing packages:" ${missing:-none}
python -c "import transformers, fairscale, h5py, yaml, sklearn, tensorboard, tqdm" || echo "WARNING: imports above fail"
SIDES=(--sides ours-masked ours-allpos hf)
if ! python -c "import accelerate" 2>/dev/null; then  # transformers.Trainer needs it
  SIDES=(--sides ours-masked ours-allpos); echo "no accelerate: the MFU benchmark runs without its hf side"
fi

# ---- 2-5 ------------------------------------------------------------------------------------------------------
stage test_gpu 170 python -m pytest -q -rs --durations=8 tests/test_gpu.py
# Its checkpoints stay in /tmp (only logs go to $OUT); the per-run outputs are copied next to the logs.
stage gpu_sharded 200 env OUT=/tmp/gpu_session_sharded bash benchmarks/gpu_sharded.sh
mkdir -p "$LOG/sharded" && (cd /tmp/gpu_session_sharded 2>/dev/null \
  && find . -name '*.out' -exec cp --parents {} "$LOG/sharded" \;)
stage bert_mfu 110 python benchmarks/bench_bert_mfu.py --model bert-base --precision bf16 --batch 64 \
  --steps 30 --rounds 8 --workers 4 "${SIDES[@]}"
stage overhead 45 python benchmarks/bench_trainer_overhead.py --device cuda --rounds 10 --steps 50
stage vs_hf_bart 90 python benchmarks/bench_vs_hf.py --device cuda --config configs/sst2_bart.yml \
  --set model.pretrained_dir=null --steps 50 --rounds 3  # BART-base shapes vs transformers.Trainer (issue 12)
stage bert_mfu_hdf5 90 python benchmarks/bench_bert_mfu.py --model bert-base --precision bf16 --batch 64 \
  --steps 20 --rounds 4 --workers 8 --data hdf5 --sides ours-masked

echo; echo "=== summary (${SECONDS}s in all)"
printf '%s\n' "${SUMMARY[@]}"
