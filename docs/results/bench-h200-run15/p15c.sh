# Run 15, call C: engine cases at vLLM's defaults with the plugin's defaults (coding on by default).
[ -d /tmp/site/vllm ] || { echo "NOSITE: vLLM not staged on this machine"; exit 3; }
source .gpurun/env.sh
END=$((SECONDS+${BUDGET:-580}))
left() { echo $((END-SECONDS)); }
CASES="${CASES:-llama-full deepseek_v2-piecewise qwen3_moe-full_decode_only}" BUDGET=$(($(left)-20)) bash .gpurun/e8.sh
grep -h "graph-sleep sleep\|did not decode\|no device memory\|the coder compiled\|backups are\|jit_monitor" $OUT/engine-*-children.log | sed 's/.*graph-sleep/graph-sleep/' | head -80 > $OUT/coded-sleeps.txt
(cd $OUT && tar czf logs-c.tgz engine-* 2>/dev/null; rm -rf engine-*)
stamp "done left $(left)"
