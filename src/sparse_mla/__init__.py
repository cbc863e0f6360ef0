"""sparse-mla: DeepSeek sparse MLA attention for serving (V4 swa / c4a / c128a over paged caches).

The public API is importable from here; each name loads its module on first use, so
``import sparse_mla`` stays fast (no torch or Triton kernels until a name is needed: ~10 ms, against
~2 s for the ops with torch and Triton).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module (relative to this package) that defines it
_EXPORTS: dict[str, str] = {
    "SparseMLAAttention": ".layer",
    "PagedCache": ".cache",
    "Request": ".batch",
    "StepBatch": ".batch",
    "StepBatchBuilder": ".batch",
    "MetadataSpec": ".metadata",
    "StepMetadata": ".metadata",
    "build_step_metadata": ".metadata",
    "sparse_attention_decode": ".ops",
    "sparse_attention_prefill": ".ops",
    "quantize_and_insert": ".ops",
    "dequantize_and_gather": ".ops",
    "longest_first": ".ops",
    "merge_partials": ".ops",
    "RankLayout": ".context_parallel",
    "RankBatchBuilder": ".context_parallel",
    "RankStepMetadata": ".context_parallel",
    "build_rank_metadata": ".context_parallel",
    "PartialsGather": ".context_parallel",
    "get_config": ".config",
    "KVFormat": ".formats",
    "get_format": ".formats",
    "KVCompressor": ".compressor",
    "CompressorStatePool": ".compress_state",
    "CompressMetadata": ".compress_metadata",
    "build_compress_metadata": ".compress_metadata",
    "insert_index_keys": ".index_keys",
    "IndexerKeyCache": ".indexer_cache",
    "SparseMLAIndexer": ".indexer_layer",
    "RopeSpec": ".rope",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    """Load a public name's module on first access (PEP 562) and cache the name in this module."""
    if name == "__version__":
        value: Any = _version()
        globals()[name] = value
        return value
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def _version() -> str:
    """The installed distribution's version (pyproject.toml is its one source); ``0+unknown`` for a source tree
    on ``sys.path`` that is not installed. Read on first use: importlib.metadata costs ~0.1 s to import."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sparse-mla")
    except PackageNotFoundError:
        return "0+unknown"


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # static checkers and IDEs see the names directly ("X as X": a re-export)
    from .batch import Request as Request
    from .batch import StepBatch as StepBatch
    from .batch import StepBatchBuilder as StepBatchBuilder
    from .cache import PagedCache as PagedCache
    from .compress_metadata import CompressMetadata as CompressMetadata
    from .compress_metadata import build_compress_metadata as build_compress_metadata
    from .compress_state import CompressorStatePool as CompressorStatePool
    from .compressor import KVCompressor as KVCompressor
    from .config import get_config as get_config
    from .formats import KVFormat as KVFormat
    from .formats import get_format as get_format
    from .index_keys import insert_index_keys as insert_index_keys
    from .indexer_cache import IndexerKeyCache as IndexerKeyCache
    from .indexer_layer import SparseMLAIndexer as SparseMLAIndexer
    from .layer import SparseMLAAttention as SparseMLAAttention
    from .metadata import MetadataSpec as MetadataSpec
    from .metadata import StepMetadata as StepMetadata
    from .rope import RopeSpec as RopeSpec
    from .metadata import build_step_metadata as build_step_metadata
    from .ops import dequantize_and_gather as dequantize_and_gather
    from .ops import longest_first as longest_first
    from .ops import quantize_and_insert as quantize_and_insert
    from .ops import sparse_attention_decode as sparse_attention_decode
    from .ops import sparse_attention_prefill as sparse_attention_prefill
