export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
stamp() { echo "$(date +%H:%M:%S) $*" | tee -a $OUT/timeline.txt; }
