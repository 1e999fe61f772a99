"""The built-in generation server, its own process (``python -m asyncrl.engine``): vLLM's HTTP subset over a
continuously batched transformers model. The trainer side that launches and checks it is asyncrl/serving/."""
