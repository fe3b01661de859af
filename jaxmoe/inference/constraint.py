"""The hook through which a request constrains its own sampling (thinking budgets, grammars).

The engine asks a request's constraint which tokens may come next each time the request samples,
masks the logits with the answer, and tells the constraint the token that was drawn. A
constraint is host-side state of one request (it sees only that request's tokens); a preempted
request keeps it, since its tokens are fed again rather than sampled again.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Constraint(Protocol):
    def allowed(self) -> np.ndarray | None:
        """Boolean ``[V]`` (the model's vocabulary) of the tokens allowed next; None: any token."""

    def accept(self, token: int) -> None:
        """Records the token sampled (called once for every token the request generates)."""
