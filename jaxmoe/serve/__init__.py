"""``jaxmoe serve``: OpenAI- and Anthropic-compatible HTTP serving over the inference engine."""

from jaxmoe.serve.app import ServeConfig, build_service, create_app

__all__ = ["ServeConfig", "build_service", "create_app"]
