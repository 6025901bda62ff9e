"""pagedllm: a paged-KV LLM engine with a vLLM-shaped offline API and a Triton Python backend."""

from pagedllm.llm import LLM
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
