"""A whole decode step in one CUDA graph: the step's metadata build and every layer, captured once and
replayed for later steps whose batches have the same shape.

What a replay reads is fixed at capture: the builder's batch buffers (refilled by each
``StepBatchBuilder.build``), the metadata buffers (``build_step_metadata(batch, spec, out=meta)`` refills
them inside the graph), the caches, the layers' sinks and whatever q / picks / out tensors the step function
used. So the step function must write into the same metadata object and read the same tensors every time, and a
replayed batch must come from the same builder with the same shape: requests, decode requests, decode tokens and
tokens (the host numbers the launches were planned with). Prefill rows are not allowed: their workspace chunks are
planned on the host from each batch's lengths. A layer's sink replaced or resized after the capture makes
:meth:`StepGraph.replay` raise ``ValueError`` (values written into it in place are read).

The metadata is stale from the builder's next ``build`` until that batch is replayed (its reads raise
``ValueError``, as after any build); :meth:`StepGraph.replay` makes it the replayed batch's, so eager reads and
layer calls after a replay see the new step. The staleness checks are host-side integer compares that run only
in eager Python: a captured graph contains none of them.
"""
from __future__ import annotations

from typing import Callable

import torch

from .batch import StepBatch
from .layer import check_sinks_kept, record_sinks
from .metadata import StepMetadata


def batch_shape(batch: StepBatch) -> tuple[int, int, int, int]:
    """What a captured step's launches depend on: (requests, decode requests, decode tokens, tokens)."""
    return batch.num_reqs, batch.num_decodes, batch.num_decode_tokens, batch.num_tokens


def sized_plans(meta: StepMetadata) -> list:
    """The plans of ``meta``'s step that bound what a replay of it may read (the layers': the caches' blocks; the
    indexer's: the lengths its launches were sized from), each with ``replay_mismatch(batch) -> str | None``: whether
    a later batch still fits them."""
    return [plan for plan in meta._plans.values() if hasattr(plan, "replay_mismatch")]


class StepGraph:
    """``step(batch)`` (build the metadata into ``meta`` with ``out=meta``, run the layers) captured in one CUDA
    graph; :meth:`replay` runs it again for a new batch of the same builder and shape.

    step: the step function; batch: the batch to capture with (decode requests only, CUDA); meta: the metadata
    object ``step`` builds into (kept current across replays, so eager calls after a replay see the new batch);
    warmup: eager calls before capture (compiles kernels, makes the step's plans).
    """

    def __init__(self, step: Callable[[StepBatch], None], batch: StepBatch, meta: StepMetadata,
                 warmup: int = 1) -> None:
        if not isinstance(batch, StepBatch) or not isinstance(meta, StepMetadata):
            raise TypeError("batch must be a StepBatch and meta the StepMetadata the step builds into")
        if batch.device.type != "cuda":
            raise ValueError(f"a CUDA graph needs the batch on a CUDA device, got {batch.device}")
        if batch.num_prefills:
            raise ValueError(f"a captured step takes decode requests only; the batch has {batch.num_prefills} "
                             f"prefill request(s)")
        # the step function is not kept: what it closes over (a model's cache, say) stays the caller's to free
        self.meta, self.shape, self.builder = meta, batch_shape(batch), batch.builder
        stream = torch.cuda.Stream(device=batch.device)
        stream.wait_stream(torch.cuda.current_stream(batch.device))
        with torch.cuda.stream(stream):  # warm-up off the default stream, as graph capture asks
            for _ in range(warmup):
                step(batch)
        torch.cuda.current_stream(batch.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # captured on the batch's device (the current one may be another GPU: the launches would run there, uncaptured)
        # and its own side stream (torch.cuda.graph's default one lives on the device current at its first use)
        with (torch.cuda.device(batch.device), record_sinks() as sinks,
              torch.cuda.graph(self.graph, stream=stream)):
            step(batch)
        # each captured layer's sink once (a replay checks they are still the captured tensors, as laid out then)
        self.sinks = list({id(layer): (layer, seen) for layer, seen in sinks}.values())
        if meta.batch is not batch:
            raise ValueError("the step function must build the metadata into meta (build_step_metadata(..., out=meta))")
        self.sized = sized_plans(meta)

    def mismatch(self, batch: StepBatch) -> str | None:
        """Why :meth:`replay` would refuse ``batch`` (None: it replays it): another builder, another shape, a block
        past a captured cache, or lengths past what a captured plan was sized for. The batch must be its builder's
        current one (else ``ValueError``)."""
        if batch.builder is not self.builder:
            return ("batch comes from another StepBatchBuilder than the captured step's: the graph reads the "
                    "capturing builder's buffers")
        batch.check_current()
        if batch_shape(batch) != self.shape:
            return (f"batch has shape {batch_shape(batch)} (requests, decode requests, decode tokens, tokens), the "
                    f"captured step {self.shape}: capture another graph for it")
        for plan in self.sized:
            reason = plan.replay_mismatch(batch)
            if reason is not None:
                return reason
        return None

    def replay(self, batch: StepBatch) -> None:
        """Run the captured step for ``batch``: the current batch of the same builder, of the captured shape, within
        the captured caches and plans (else ``ValueError`` saying why: :meth:`mismatch`)."""
        reason = self.mismatch(batch)
        if reason is not None:
            raise ValueError(reason)
        check_sinks_kept(self.sinks)  # a few hundred ns per layer with a sink
        self.graph.replay()
        self.meta.batch = batch
