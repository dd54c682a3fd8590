# Run 15, call A (right after the vLLM install): codec unit tests, coder profile at 8B size with
# today's default (unspecialized kernels, warm-up prepare timed), allocator GPU tests.
source .gpurun/env.sh
END=$((SECONDS+${BUDGET:-560}))
left() { echo $((END-SECONDS)); }
[ -d /tmp/site/vllm ] || stamp "NOSITE"
python3 -c "import triton, torch, vllm; print('triton', triton.__version__, 'torch', torch.__version__, 'vllm', vllm.__version__)" > $OUT/versions.txt 2>&1
stamp "codec left $(left)"
timeout 120 python3 -m pytest -v -rs tests/unit/test_exponent_codec.py tests/unit/test_coded_backups.py > $OUT/codec-unit.log 2>&1
stamp "codec unit rc $? left $(left)"
LAYERS=32 timeout 200 python3 .gpurun/coder_profile.py > $OUT/profile-8b.log 2>&1
stamp "profile rc $? left $(left)"
timeout $(($(left)-5)) python3 -m pytest -v -s -rs tests/basic_correctness/memory/cumem/test_cumem.py > $OUT/cumem.log 2>&1
stamp "cumem rc $? left $(left)"
