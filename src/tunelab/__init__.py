"""tunelab: fine-tune causal language models end to end."""

__version__ = "0.1.0"
