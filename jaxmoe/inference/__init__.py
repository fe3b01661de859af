"""The inference engine: paged hybrid caches, continuous batching, sampling."""

from jaxmoe.inference.cache import CacheSpec
from jaxmoe.inference.engine import Completion, Engine, EngineConfig
from jaxmoe.inference.sampler import SamplingParams
from jaxmoe.inference.scheduler import Images, Request

__all__ = ["CacheSpec", "Completion", "Engine", "EngineConfig", "Images", "Request", "SamplingParams"]
