"""The API server process, and the offline Python API built on the same engine client:
``from api_server import LLM, SamplingParams``."""

from api_server.offline import LLM, CompletionOutput, GenerationResult, SamplingParams

__all__ = ["LLM", "CompletionOutput", "GenerationResult", "SamplingParams"]
