python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/tf scratch/tfwheel/*.whl && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
PYTHONPATH=/tmp/tf:$PYTHONPATH timeout 120 python3 scratch/s6_parts.py 2>&1 | grep -v -i warn | cut -c1-200 | tail -60
PYTHONPATH=/tmp/tf:$PYTHONPATH timeout 330 python3 benchmarks/s6_parakeet.py --runs 2 --baseline-runs 2 --out $OUT 2>&1 | grep -v Warning | tail -22
