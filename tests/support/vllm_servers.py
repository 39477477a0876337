"""vLLM servers for the tests: plain, or with kvroom's connector behind a kvroom bootstrap. They
live in ``launcher.vllm_servers``, which the benchmark shares."""

from launcher.vllm_servers import CONNECTOR, ROOT, VLLM_PYTHON, VllmCluster, VllmServer, tiny_llama

__all__ = ["CONNECTOR", "ROOT", "VLLM_PYTHON", "VllmCluster", "VllmServer", "tiny_llama"]
