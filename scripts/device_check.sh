#!/usr/bin/env bash
# What only a GPU can check, in one run of about nine minutes on one lent CUDA GPU.
#
#   bash scripts/device_check.sh [OUT]          # OUT: where the results go (default /tmp/device-check)
#   DEVICE=cpu bash scripts/device_check.sh OUT # the same steps, a few seconds each, off a GPU (tries the script)
#
# 1. train: `cocodiff train-tiny --device cuda`, tiny-shapes trained on from the shipped weights
#    (their autoencoder kept). A short run first times a step; the run then takes as many steps as
#    fit in TRAIN_S seconds. The parts and training.json come back as OUT/shapes-weights.tar; check
#    them here with `python -m cocodiff.models.shapes.evaluate --weights DIR` (the default prompt
#    on seeds 0-3) before they replace cocodiff/models/shapes/weights.
# 2. suite: `pytest -m gpu`, the checks added last first (every rank of each world computing on
#    the GPU, V-First's V on cuBLAS in bf16, the attention backends at FLUX.1-dev's shapes), then
#    the rest of the GPU suite and train-tiny's repeatability on CUDA. Figures: OUT/gpu-first.json
#    and OUT/gpu-rest.json, merged here into docs/results/gpu-<device>.json.
#
# Knobs: TOTAL_S (the whole run, default 560: inside a 600-second call), TRAIN_S (seconds of
# training, default 180), TRAIN_BATCH (48), PHASES ("train suite"). Each step is bounded by
# `timeout`, within what is left of TOTAL_S; one that runs over is reported and the next one runs.
# The log is OUT/log.txt.
#
# A machine without diffusers takes it from wheels in .whl/ (an ignored folder carried along):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl diffusers==0.42.1
set -u
OUT=${1:-${OUT:-/tmp/device-check}}
DEVICE=${DEVICE:-cuda}
TOTAL_S=${TOTAL_S:-560}
TRAIN_S=${TRAIN_S:-180}
TRAIN_BATCH=${TRAIN_BATCH:-48}
PHASES=${PHASES:-train suite}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
if ! "$PY" -c "import diffusers" 2>/dev/null; then
    ls .whl/*.whl >/dev/null 2>&1 || { echo "device_check: no diffusers and no wheels in .whl/"; exit 2; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
"$PY" -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
if [ "$DEVICE" = cuda ] && ! "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    echo "device_check: no CUDA device here (DEVICE=cpu tries the script on the CPU)"; exit 2
fi
phase() { echo "== $1 (${SECONDS} s in)"; }
left() { local n=$((TOTAL_S - SECONDS)); ((n > $1)) && n=$1; ((n < 1)) && n=1; echo "$n"; }  # at most $1 seconds, within TOTAL_S

if [[ " $PHASES " == *" train "* ]]; then
    phase train
    work=/tmp/device-check-train; rm -rf "$work"
    if [ "$DEVICE" = cpu ]; then timed=4; TRAIN_BATCH=4; else timed=100; fi
    common=(--device "$DEVICE" --init cocodiff/models/shapes/weights --batch "$TRAIN_BATCH" --no-samples)
    timeout "$(left 90)" "$PY" -m cocodiff train-tiny --out "$work/timing" --seed 2 --steps "$timed" "${common[@]}" >"$work.timing.log" 2>&1
    steps=$("$PY" - "$work/timing/training.json" "$timed" "$TRAIN_S" "$DEVICE" <<'EOF'
import json, sys
record, timed, budget, device = json.load(open(sys.argv[1])), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
per_step = record["wall_s"] / timed
print(8 if device == "cpu" else max(500, int(0.85 * budget / per_step) // 500 * 500))
print(f"{per_step * 1e3:.1f} ms a step at batch {record['batch']}", file=sys.stderr)
EOF
    ) || { echo "train: the timing run failed"; tail -5 "$work.timing.log"; steps=""; }
    if [ -n "$steps" ]; then
        echo "train: $steps steps"
        timeout "$(left $((TRAIN_S + 45)))" "$PY" -m cocodiff train-tiny --out "$work/run" --seed 2 --steps "$steps" \
            --lr 5e-4 --decay-share 0.25 "${common[@]}" >"$work.log" 2>&1
        echo "train: exit $? ($(tail -c 300 "$work.log" | tr '\r' '\n' | tail -1))"
        [ -f "$work/run/training.json" ] && tar cf "$OUT/shapes-weights.tar" -C "$work/run" transformer text_encoder vae scheduler training.json \
            && echo "train: $OUT/shapes-weights.tar"
    fi
fi

if [[ " $PHASES " == *" suite "* ]]; then
    phase suite
    first="test_every_rank_on_cuda_tensors or test_v_first_finds_v_on_cublas_in_bf16 or test_attention_backends_at_flux_dev_shapes"
    if [ "$DEVICE" = cpu ]; then  # what the first checks run, on the CPU, a few cases each
        timeout "$(left 300)" "$PY" - <<'EOF'
import json, sys, time
sys.path.insert(0, "tests")
import torch
import test_gpu as gpu

row = gpu.every_rank_on("cpu", gpu._every_rank_cases()[:: 8])
print("every rank:", json.dumps(row))
assert not row["mismatches"]
print("V-First:", {m: gpu.v_first_constructions(m, "cpu", torch.bfloat16) == gpu.v_first_constructions(m, "cpu", torch.float32)
                   for m in gpu.V_FIRST_MODELS[:2]})
clock = lambda fn: (lambda t: (fn(), (time.perf_counter() - t) * 1e3)[1])(time.perf_counter())
rows = gpu.backend_times("cpu", {"small": (2, 256)}, clock)
print("backends:", {name: row for name, row in rows.items() if isinstance(row, dict)})
EOF
        echo "suite: exit $?"
    else
        COCODIFF_GPU_JSON="$OUT/gpu-first.json" timeout "$(left 240)" "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k "$first"
        echo "suite (first): exit $?"
        COCODIFF_GPU_JSON="$OUT/gpu-rest.json" timeout "$(left 600)" "$PY" -m pytest -q -p no:cacheprovider -m gpu \
            tests/test_train_tiny_device.py tests/test_gpu.py -k "not ($first)"
        echo "suite (rest): exit $?"
    fi
fi
phase done
