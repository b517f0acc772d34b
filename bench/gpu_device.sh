#!/usr/bin/env bash
# The GPU checks in one call on a lent GPU machine (bench/README.md, "GPU"): ortools from
# the wheels carried in .whl, then `pytest -m cuda tests/integration/test_cuda.py` and bench/gpu.py for
# each model, all at once on the one GPU (each row's step ratio is to eager interleaved in
# its own process), every log under $OUT (8 files).
#   TESTS_S, BENCH_S, ROW_S: caps in seconds; MODELS; GPT2_ROWS, LLAMA_ROWS: bench rows;
#   QUICK=1: small configs (the flow, on CPU too).
set -u
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}; mkdir -p "$OUT"
if ! python3 -c "import ortools" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/env.txt" 2>&1 || { cat "$OUT/env.txt"; exit 1; }
fi
# The checkout is not installed there: solvers/ is importable as remat_solvers through a link.
mkdir -p /tmp/site && ln -sfn "$PWD/solvers" /tmp/site/remat_solvers
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/env.txt" 2>&1
python3 -c "import torch, transformers, ortools; print(torch.__version__, transformers.__version__, ortools.__version__)" \
  >> "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
start=$SECONDS
(timeout "${TESTS_S:-170}" python3 -m pytest -q -m cuda tests/integration/test_cuda.py -p no:cacheprovider > "$OUT/cuda_tests.log" 2>&1
 echo "tests: exit $? after $((SECONDS - start)) s" >> "$OUT/cuda_tests.log") &
for model in ${MODELS:-gpt2 llama}; do
  rows=$([ "$model" = gpt2 ] && echo "${GPT2_ROWS:-}" || echo "${LLAMA_ROWS:-}")
  timeout "${BENCH_S:-400}" python3 bench/gpu.py --models "$model" ${rows:+--rows "$rows"} ${QUICK:+--quick} \
    --limit-s $(( ${BENCH_S:-400} - 10 )) --row-limit-s "${ROW_S:-150}" \
    --out "$OUT/gpu_$model.json" --log "$OUT/${model}_stderr.log" > "$OUT/$model.txt" 2>&1 &
done
wait
echo "done after $((SECONDS - start)) s"
tail -30 "$OUT/cuda_tests.log"
for model in ${MODELS:-gpt2 llama}; do cat "$OUT/$model.txt"; done
