"""Methods posttrain adds to every vLLM worker (``worker_extension_cls``), called by name through
``LLM.collective_rpc`` so that they reach each tensor-parallel worker, in this process or in vLLM's own.

A weight sync is ``reload_begin`` → ``reload_bucket`` per bucket → ``reload_end``: vLLM's layerwise
reload (``vllm.model_executor.model_loader.reload``) puts the layers back into their checkpoint layout,
loads each bucket through the model's ``load_weights`` (HF names; vLLM fuses q/k/v and gate/up and shards
for tensor parallelism itself), and processes each layer again once all its weights arrived (the CPU build
repacks every linear weight for oneDNN after loading, so a plain ``load_weights`` into the live model
fails there: "'Parameter' object has no attribute 'weight_loader'"). A layer must receive all its weights
within one sync (a fused q/k/v needs q, k, v and their biases): a layer given only some of them would be
processed with the rest uninitialised."""
from __future__ import annotations


class PosttrainWorkerExtension:
    """Mixed into vLLM's worker class: ``self`` is the worker (``self.model_runner`` holds the model)."""

    def posttrain_reload_begin(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model_runner.get_model())

    def posttrain_reload_bucket(self, weights) -> int:
        """Load one bucket of ``(hf name, tensor)`` pairs (or safetensors bytes of them: an engine core in a
        process of its own); returns how many arrived."""
        if isinstance(weights, (bytes, bytearray, memoryview)):
            from safetensors.torch import load

            weights = load(bytes(weights)).items()
        weights = list(weights)
        self.model_runner.get_model().load_weights(weights=weights)
        return len(weights)

    def posttrain_reload_end(self) -> None:
        """Process the layers still waiting, restore the others, and drop what was computed with the old
        weights (the encoder and multimodal caches; the prefix cache is the engine's: ``reset_prefix_cache``)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        runner = self.model_runner
        finalize_layerwise_reload(runner.get_model(), runner.model_config)
        for reset in ("reset_encoder_cache", "reset_mm_cache"):
            if hasattr(runner, reset):
                getattr(runner, reset)()

    def posttrain_die_with_parent(self) -> None:
        """An engine core process of its own (``AsyncLLM``) is killed with the thread that started it (Linux
        ``PR_SET_PDEATHSIG``), so a killed Ray actor leaves no engine behind."""
        import ctypes
        import signal
        import sys

        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG

    def posttrain_model_class(self) -> str:
        return type(self.model_runner.get_model()).__name__
