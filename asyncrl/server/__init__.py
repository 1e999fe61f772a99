"""Generation servers: the built-in transformers server and the launch of vLLM."""
