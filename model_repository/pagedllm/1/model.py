"""Triton loads this file; the model itself lives in the installed `pagedllm` package."""

from pagedllm.serving.triton_model import TritonPythonModel  # noqa: F401
