# Run 14, call A (no vLLM staged): the pipelined coder's sleep side, codec unit tests, cumem GPU tests.
source .gpurun/env.sh
END=$((SECONDS+${BUDGET:-560}))
left() { echo $((END-SECONDS)); }
python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)" > $OUT/versions.txt 2>&1
stamp "build left $(left)"
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/build.log 2>&1
stamp "build rc $? left $(left)"
timeout 120 python3 -m pytest -v -rs tests/unit/test_exponent_codec.py > $OUT/codec-unit.log 2>&1
stamp "codec unit rc $? left $(left)"
timeout 200 python3 .gpurun/coder_profile.py > $OUT/profile.log 2>&1
stamp "profile rc $? left $(left)"
timeout $(($(left)-5)) python3 -m pytest -v -s -rs tests/basic_correctness/memory/cumem/test_cumem.py > $OUT/cumem.log 2>&1
stamp "cumem rc $? left $(left)"
