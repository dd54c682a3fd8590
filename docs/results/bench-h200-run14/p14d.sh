# Run 14, call D: engine cases at vLLM's defaults with coded backups on (the MoE shapes never ran
# coded), then llama FULL_AND_PIECEWISE without.
[ -d /tmp/site/vllm ] || { echo "NOSITE: vLLM not staged on this machine"; exit 3; }
source .gpurun/env.sh
END=$((SECONDS+${BUDGET:-580}))
left() { echo $((END-SECONDS)); }
VLLM_GRAPH_SLEEP_COMPRESS_BACKUPS=1 CASES="${CODED_CASES:-deepseek_v2-full_and_piecewise qwen3_moe-full_and_piecewise llama-full_and_piecewise}" BUDGET=$(($(left)-20)) bash .gpurun/e8.sh
grep -h "graph-sleep sleep\|did not decode\|no device memory" $OUT/engine-*-children.log | sed 's/.*graph-sleep/graph-sleep/' | sort | uniq -c | sort -rn | head -20 > $OUT/coded-sleeps.txt
(cd $OUT && tar czf logs-d.tgz engine-* 2>/dev/null; rm -rf engine-*)
stamp "done left $(left)"
