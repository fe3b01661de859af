"""jaxmoe: a hybrid MLA / DSA / KDA sparse Mixture-of-Experts language model in JAX + Flax NNX."""

__version__ = "0.1.0"
