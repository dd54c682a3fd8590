"""Stand-in for benchmarks/checkpoint_residue.py's --hold-context child (stdlib only).

    python fake_context_holder.py HOLDING_LINE CHECK_WORD INFO_PREFIX VARIANT

Prints INFO_PREFIX with a JSON object naming VARIANT, then HOLDING_LINE once
"ready", answers every CHECK_WORD line with
"CHECK_WORD ok" ("CHECK_WORD bad" with FAKE_HOLDER_BAD=1: a buffer that did not
survive the restore) and exits when its input closes. The tests' fake libcuda
and fake NVML treat it as a process holding a CUDA context.
"""

import os
import sys

holding, check, info, variant = sys.argv[1:5]
print(f'{info} {{"fake": "{variant}"}}', flush=True)
print(holding, flush=True)
for line in sys.stdin:
    if line.strip() == check:
        verdict = "bad" if os.environ.get("FAKE_HOLDER_BAD") == "1" else "ok"
        print(f"{check} {verdict}", flush=True)
