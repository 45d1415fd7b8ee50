"""Paged attention: the step's page table (metadata) and the backends that read it."""

from radixserve.attention.backend import AttentionBackend, BackendUnavailable, create_backend
from radixserve.attention.metadata import AttentionMetadata, SeqSpan, build_metadata
from radixserve.attention.torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "BackendUnavailable", "SeqSpan",
           "TorchAttentionBackend", "build_metadata", "create_backend"]
