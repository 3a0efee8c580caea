python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/tf scratch/tfwheel/*.whl && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH || exit 1
export PYTHONUNBUFFERED=1
PYTHONPATH=/tmp/tf:$PYTHONPATH timeout 90 python3 -m pytest -q -p no:cacheprovider tests/model/test_fastconformer_engine.py tests/model/test_transducer_device_loop.py 2>&1 | grep -E "^E |passed|failed" | head -20
PYTHONPATH=/tmp/tf:$PYTHONPATH timeout 150 python3 benchmarks/s6_parakeet.py --runs 5 --baseline-runs 2 --out $OUT 2>&1 | grep -E "INFO s6: (baseline|ours)|^\||identical|Error|error|differ" | tail -18
