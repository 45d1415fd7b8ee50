"""radixserve: an LLM inference server built around a RadixAttention prefix cache."""

__version__ = "0.1.0"
