# Run 14, call B (after the vLLM install): the pipelined coder at 8B size, codec unit + cumem tests.
source .gpurun/env.sh
END=$((SECONDS+${BUDGET:-560}))
left() { echo $((END-SECONDS)); }
[ -d /tmp/site/vllm ] || echo "NOSITE" >> $OUT/timeline.txt
stamp "profile left $(left)"
LAYERS=32 timeout 200 python3 .gpurun/coder_profile.py > $OUT/profile-8b.log 2>&1
stamp "profile rc $? left $(left)"
timeout 120 python3 -m pytest -v -rs tests/unit/test_exponent_codec.py > $OUT/codec-unit.log 2>&1
stamp "codec unit rc $? left $(left)"
timeout $(($(left)-5)) python3 -m pytest -v -s -rs tests/basic_correctness/memory/cumem/test_cumem.py > $OUT/cumem.log 2>&1
stamp "cumem rc $? left $(left)"
