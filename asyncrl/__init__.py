"""asyncrl: an asynchronous GRPO trainer for language models."""

__version__ = "0.1.0"
