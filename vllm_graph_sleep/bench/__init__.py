"""`vllm-graph-sleep bench`: real `vllm serve` processes per configuration, driven
over HTTP through sleep and wake cycles, measured with NVML and the worker probe.

One job per module:
- `settings`: what a run does (configurations, levels, wake modes, prompts);
- `gpu`: which GPUs the servers use, NVML used memory, settling, background sampling;
- `server`: start one `vllm serve` with its log, wait for /health, stop it always;
- `phases`: what a starting server does, from its log (the progress while it waits);
- `estimate`: how long a run will take, said before it starts;
- `client`: the HTTP calls (completions with token ids, sleep, wake, probe, reload);
- `scenario`: one configuration from start to stop (the measurements);
- `report`: summary, side-by-side table, JSON;
- `plot`: the PNG of memory over time (matplotlib, the bench extra);
- `charts`: the PNGs of asleep memory with the floor, and of the level-1 wake;
- `runner`: the settings, the model, every configuration in turn, the outputs.
"""
