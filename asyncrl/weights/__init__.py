"""Both ends of a weight transfer. The trainer's: the transports of each backend (the data plane; the round's
control calls are trainer/weight_sync.py's) and adapter-only sync. vLLM's: the worker extension and its shared
buffer, imported inside vLLM's worker process (vllm_extension.py, weight_buffer.py), so this package imports
nothing. The built-in server's end is asyncrl/engine/weight_updates.py."""
