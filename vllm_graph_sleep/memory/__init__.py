"""The mechanisms under the sleep-mode allocator, one collaborator per module,
each the only owner of its state. `vllm_graph_sleep.allocator.GraphSleepAllocator`
is the facade that composes them; these modules import torch and our settings,
never vLLM, and never the facade."""
