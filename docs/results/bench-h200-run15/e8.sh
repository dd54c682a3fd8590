# Engine cases of test_graph_offload.py at vLLM's defaults (0.92, default capture sizes), one
# pytest per case; CASES="kind-mode ...".
source .gpurun/env.sh
END=$((SECONDS+${BUDGET:-560}))
for c in $CASES; do
  kind=${c%%-*}; mode=${c#*-}; left=$((END-SECONDS))
  if [ $left -lt 90 ]; then stamp "$c skipped, left $left"; continue; fi
  stamp "$c left $left"
  GRAPH_SLEEP_TEST_VLLM_DEFAULTS=1 GRAPH_SLEEP_TEST_LOG=$OUT/engine-defaults-$c-children.log \
    GRAPH_SLEEP_TEST_TIMEOUT=$((left-15)) timeout -k 5 $((left-5)) python3 -m pytest -v -rs --durations=3 \
    "tests/basic_correctness/memory/sleep_mode/test_graph_offload.py::test_graphs_live_in_the_pool_and_tokens_survive_cycles[$kind-$mode]" \
    > $OUT/engine-defaults-$c.log 2>&1
  stamp "$c rc $?"
done
