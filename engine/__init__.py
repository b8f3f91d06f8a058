"""Tandem's model runtime: paged KV cache, packed batched prefill, continuous-batching decode.

Offline use mirrors vLLM: `from engine import LLM, SamplingParams`.
"""
from engine.config import EngineConfig, ModelConfig
from engine.core.llm_engine import EngineClosed, LLMEngine
from engine.llm import LLM
from engine.outputs import CompletionOutput, Logprob, RequestOutput, StepDelta
from engine.sampling.logprobs import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.structured_params import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "ModelConfig", "LLMEngine", "EngineClosed", "RequestOutput",
           "CompletionOutput", "StepDelta", "Logprob", "TokenLogprobs", "StructuredOutputsParams"]
