# Run 15, call B: the 8B with what ships (ours = coded by default), ours_raw, stock with graphs.
[ -d /tmp/site/vllm ] || { echo "NOSITE: vLLM not staged on this machine"; exit 3; }
source .gpurun/env.sh
END=$((SECONDS+${BUDGET:-580}))
left() { echo $((END-SECONDS)); }
stamp "8b left $(left)"
timeout -k 10 $(($(left)-15)) python3 -m vllm_graph_sleep.cli bench --model-kind llama_8b --out $OUT/bench-8b --configs ours ours_raw stock_graphs --cycles 1 --warm-starts 0 --no-floor > $OUT/bench-8b.log 2>&1
stamp "8b rc $? left $(left)"
cp $OUT/bench-8b/table.txt $OUT/table-8b.txt 2>/dev/null
cp $OUT/bench-8b/results.json $OUT/results-8b.json 2>/dev/null
for f in $OUT/bench-8b/*server*; do echo "== $f"; grep -h "graph-sleep wake_up\|graph-sleep sleep\|did not decode\|no device memory\|the coder compiled\|backups are\|jit_monitor" $f | sed 's/.*graph-sleep/graph-sleep/'; done > $OUT/phases-8b.txt 2>/dev/null
(cd $OUT && tar czf logs-b.tgz bench-8b bench-8b.log 2>/dev/null; rm -rf bench-8b)
stamp "done left $(left)"
