"""Methods posttrain adds to every vLLM worker (``worker_extension_cls``), called by name through
``LLM.collective_rpc`` so that they reach each tensor-parallel worker, in this process or in vLLM's own.

A weight sync is ``reload_begin`` → ``reload_bucket`` per bucket → ``reload_end``: vLLM's layerwise
reload (``vllm.model_executor.model_loader.reload``) puts the layers back into their checkpoint layout,
loads each bucket through the model's ``load_weights`` (HF names; vLLM fuses q/k/v and gate/up and shards
for tensor parallelism itself), and processes each layer again once all its weights arrived (the CPU build
repacks every linear weight for oneDNN after loading, so a plain ``load_weights`` into the live model
fails there: "'Parameter' object has no attribute 'weight_loader'"). A layer must receive all its weights
within one sync (a fused q/k/v needs q, k, v and their biases): vLLM would process a layer given only some
of them with the rest uninitialised, so ``reload_end`` raises naming such linear layers; and it ignores a
second load of a layer already processed within the same sync."""
from __future__ import annotations

import io
from collections.abc import Iterable

import torch


def bucket_bytes(weights: Iterable[tuple[str, torch.Tensor]]) -> bytes:
    """A weight bucket as ``torch.save`` bytes, for an engine core in a process of its own: vLLM's msgpack
    encoder sends a tensor argument of ``collective_rpc`` as (dtype, shape, buffer index) and the engine core
    decodes it without its buffers (``PosttrainWorkerExtension.posttrain_reload_bucket`` loads
    these bytes; tied tensors that share memory are kept, unlike safetensors)."""
    buffer = io.BytesIO()
    torch.save([(name, tensor.detach().cpu().contiguous()) for name, tensor in weights], buffer)
    return buffer.getvalue()


class PosttrainWorkerExtension:
    """Mixed into vLLM's worker class: ``self`` is the worker (``self.model_runner`` holds the model)."""

    def posttrain_reload_begin(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model_runner.get_model())

    def posttrain_reload_bucket(self, weights) -> int:
        """Load one bucket of ``(hf name, tensor)`` pairs (or their ``torch.save`` bytes:
        ``VLLMRolloutEngine._wire``); returns how many arrived."""
        if isinstance(weights, (bytes, bytearray, memoryview)):
            weights = torch.load(io.BytesIO(weights), map_location="cpu", weights_only=True)
        weights = list(weights)
        self.model_runner.get_model().load_weights(weights=weights)
        return len(weights)

    def posttrain_reload_end(self) -> None:
        """Process the layers still waiting, restore the others, and drop what was computed with the old
        weights (the encoder and multimodal caches; the prefix cache is
        the engine's: ``reset_prefix_cache``)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        runner = self.model_runner
        partial = _partial_linear_layers(runner.get_model())
        finalize_layerwise_reload(runner.get_model(), runner.model_config)
        for reset in ("reset_encoder_cache", "reset_mm_cache"):
            if hasattr(runner, reset):
                getattr(runner, reset)()
        if partial:
            raise RuntimeError(f"weight sync: {len(partial)} linear layer(s) got only some of their weights "
                               f"({', '.join(partial[:4])}): vLLM fuses them (q/k/v + biases, gate/up) and "
                               "needs all of a layer's tensors within one sync; the layer now holds "
                               "uninitialised values")

    def posttrain_packed_modules(self) -> dict[str, list[str]]:
        """The model's fused layers: vLLM layer name -> the HF module names loaded into it
        (``packed_modules_mapping``, e.g. ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}``)."""
        mapping = getattr(self.model_runner.get_model(), "packed_modules_mapping", None) or {}
        return {str(k): [str(v) for v in values] for k, values in mapping.items()}

    def posttrain_die_with_parent(self) -> None:
        """An engine core process of its own (``AsyncLLM``) is killed with the thread that started it (Linux
        ``PR_SET_PDEATHSIG``), so a killed Ray actor leaves no engine behind."""
        import ctypes
        import signal
        import sys

        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG

    def posttrain_release_kv_cache(self) -> int:
        """Free the KV cache's memory until `posttrain_restore_kv_cache`: each storage under
        ``model_runner.kv_caches`` shrinks to 0 bytes, the tensors keep their shapes (the sleep of vLLM's CPU
        build, whose own ``sleep`` frees nothing). Returns the bytes freed."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in self.model_runner.kv_caches}
        sizes = getattr(self, "_posttrain_kv_sizes", None) or {}
        for key, storage in storages.items():
            if storage.nbytes():
                sizes[key] = (storage, storage.nbytes())
                storage.resize_(0)
        self._posttrain_kv_sizes = sizes
        return sum(n for _, n in sizes.values())

    def posttrain_restore_kv_cache(self) -> int:
        """Reallocate the storages `posttrain_release_kv_cache` freed, zeroed (the prefix cache must be reset:
        its blocks are gone). Returns the bytes allocated."""
        sizes = getattr(self, "_posttrain_kv_sizes", None) or {}
        for storage, nbytes in sizes.values():
            storage.resize_(nbytes)
        for t in self.model_runner.kv_caches if sizes else ():
            t.zero_()
        self._posttrain_kv_sizes = {}
        return sum(n for _, n in sizes.values())

    def posttrain_model_class(self) -> str:
        return type(self.model_runner.get_model()).__name__


def _partial_linear_layers(model) -> list[str]:
    """Names of the linear layers that received some but not all of their weights in the current reload."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    partial = []
    for name, layer in model.named_modules():
        info = LAYERWISE_INFO.get(layer) if isinstance(layer, LinearBase) else None
        if info is not None and info.can_load() and 0 < info.load_numel < info.load_numel_total:
            partial.append(name)
    return partial
