"""specdp: data-parallel speculative decoding on Hugging Face models."""

__version__ = "0.1.0"
