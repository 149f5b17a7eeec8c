"""Launcher (`python -m launch`), process supervision and the Python API."""

from launch.admission import QueueFullError
from launch.llm import LLM
from launch.outputs import RequestMetrics, RequestOutput, StreamEvent
from protocol.lora import LoRARequest
from protocol.messages import SamplingParams
from protocol.structured import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "RequestMetrics",
           "StreamEvent", "LoRARequest", "QueueFullError"]
