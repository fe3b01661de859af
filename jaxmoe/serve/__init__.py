"""``jaxmoe serve``: OpenAI- and Anthropic-compatible HTTP serving over the inference engine.

The app (and with it the engine, FastAPI and jax) is imported on first use of its names, so that
``jaxmoe --help`` and the light subcommands (``jaxmoe compile --mesh-only``, which the launchers run
before they create anything) start without it.
"""

__all__ = ["ServeConfig", "build_service", "create_app"]


def __getattr__(name: str):
    if name in __all__:
        from jaxmoe.serve import app  # noqa: PLC0415

        return getattr(app, name)
    raise AttributeError(f"module 'jaxmoe.serve' has no attribute {name!r}")
