"""Which decoder layers run as one ``lax.scan``: the repeating blocks of a layer stack.

A 96-layer Python loop compiles 96 copies of a layer; a scan over ``n`` repetitions of a block
compiles the block once. Layers can share a scan only where their parameters have the same
structure, so each layer gets a *signature* (its attention kind and whether its FFN is dense or
MoE) and :func:`plan_layers` covers the signature sequence greedily with repeated blocks, nested
where a block itself repeats. The target's 3 mla + 24 dsa + 69 kda layers::

    0                         (mla, dense FFN): once
    Stack(period 32, x2)      layers 1-64
      Stack(period 4, x7)       kda kda dsa kda
        Stack(period 1, x2)       kda
        ...
      ...
    Stack(period 4, x7)       layers 65-92
    ...

compiles 12 layers instead of 96.

A plan is a tuple of items; an item is a layer index (run as itself) or a :class:`Stack`, whose
``block`` lists the items of its first repetition (absolute layer indices); repetition ``r``
holds those layers shifted by ``r * period``. The stacked parameter layout (``Transformer(...,
scan=True)``) follows the plan: ``layers/k`` is item ``k``, a stack's parameters sit under
``layers/k/block/j`` (``j`` a string: the block is an ``nnx.Dict``) with a leading ``[repeats]``
axis per level of nesting. :func:`stack_layers` and
:func:`unstack_layers` convert pure dicts between that layout and the per-layer one
(``layers/i``) that checkpoints, HF import and the inference engine use.

Plain Python (numpy for host arrays): no jax import, so configs and tools can plan without it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np

STACK_KEY = "block"  # the attribute (and pure-dict key) under which a stack's block lives


@dataclasses.dataclass(frozen=True)
class Stack:
    """``repeats`` consecutive repetitions of ``block`` (items of the first one), ``period`` layers each."""

    block: tuple[Item, ...]
    repeats: int
    period: int

    @property
    def start(self) -> int:
        return first_layer(self.block[0])


Item = int | Stack


def first_layer(item: Item) -> int:
    return item if isinstance(item, int) else item.start


def plan_layers(signatures: Sequence[Hashable], start: int = 0) -> tuple[Item, ...]:
    """Greedy cover of ``signatures`` (one per layer) by repeated blocks, nested.

    At each position the block length ``p`` that repeats back to back over the most layers wins
    (ties: the shorter block); a block is planned the same way inside. A position where nothing
    repeats is a single layer. ``start`` offsets the layer indices.
    """
    sig = list(signatures)
    items: list[Item] = []
    i = 0
    while i < len(sig):
        best_p, best_n = 1, 1
        for p in range(1, (len(sig) - i) // 2 + 1):
            n = 1
            while sig[i + n * p : i + (n + 1) * p] == sig[i : i + p]:
                n += 1
            if n >= 2 and n * p > best_n * best_p:
                best_p, best_n = p, n
        if best_n == 1:
            items.append(start + i)
        else:
            block = plan_layers(sig[i : i + best_p], start + i)
            items.append(Stack(block, best_n, best_p))
        i += best_n * best_p
    return tuple(items)


def layer_signatures(layer_kinds: Sequence[str], first_k_dense: int) -> tuple[tuple[str, str], ...]:
    """``(attention kind, 'dense' | 'moe')`` per layer: layers with equal signatures stack."""
    return tuple((k, "dense" if i < first_k_dense else "moe") for i, k in enumerate(layer_kinds))


def shifted(item: Item, by: int) -> Item:
    """``item`` with every layer index moved by ``by``."""
    if isinstance(item, int):
        return item + by
    return Stack(tuple(shifted(x, by) for x in item.block), item.repeats, item.period)


def layer_count(plan: Sequence[Item]) -> int:
    return sum(1 if isinstance(x, int) else x.repeats * x.period for x in plan)


def compiled_layers(plan: Sequence[Item]) -> int:
    """How many layer bodies a program of ``plan`` traces (each stack's block once)."""
    return sum(1 if isinstance(x, int) else compiled_layers(x.block) for x in plan)


def _stack(xs: Sequence[Any]):
    if all(isinstance(x, np.ndarray | np.generic) for x in xs):
        return np.stack(xs)
    import jax.numpy as jnp  # device (or traced) arrays: stacked by XLA where they lie

    return jnp.stack(xs)


def _tree_map(fn: Callable[..., Any], *trees: Any) -> Any:
    if isinstance(trees[0], Mapping):
        return {k: _tree_map(fn, *(t[k] for t in trees)) for k in trees[0]}
    if isinstance(trees[0], tuple | list):
        mapped = [_tree_map(fn, *xs) for xs in zip(*trees)]
        return type(trees[0])(*mapped) if hasattr(trees[0], "_fields") else type(trees[0])(mapped)
    return fn(*trees)


def _present(item: Item, layers: Mapping[int, Any], offset: int) -> bool:
    if isinstance(item, int):
        return item + offset in layers
    return any(_present(x, layers, offset) for x in item.block)


def _stack_item(item: Item, layers: Mapping[int, Any], offset: int) -> Any:
    if isinstance(item, int):
        return layers[item + offset]
    reps = [
        {
            STACK_KEY: {
                str(j): _stack_item(x, layers, offset + r * item.period)
                for j, x in enumerate(item.block)
                if _present(x, layers, offset)
            }
        }
        for r in range(item.repeats)
    ]
    return _tree_map(lambda *xs: _stack(xs), *reps)


def stack_layers(tree: Mapping[str, Any], plan: Sequence[Item]) -> dict:
    """A pure dict in the per-layer layout (``tree['layers'][i]``) in the stacked layout of ``plan``.

    Keys other than ``'layers'`` are kept. Layers absent from ``tree['layers']`` (a sub-tree such as
    the router biases, which only MoE layers have) must be absent from every repetition alike.
    """
    layers = tree.get("layers")
    if layers is None:
        return dict(tree)
    extra = sorted(set(layers) - set(range(layer_count(plan))))
    if extra:
        raise ValueError(f"layers {extra} are not in the plan of {layer_count(plan)} layers")
    out = {}
    for k, item in enumerate(plan):
        if isinstance(item, int):
            if item in layers:
                out[k] = layers[item]
            continue
        if _present(item, layers, 0):
            out[k] = _stack_item(item, layers, 0)
    return {**tree, "layers": out}


def _unstack_item(item: Item, sub: Any, offset: int, out: dict) -> None:
    if isinstance(item, int):
        out[item + offset] = sub
        return
    for r in range(item.repeats):
        rep = _tree_map(lambda a, r=r: a[r], sub[STACK_KEY])
        for j, x in enumerate(item.block):
            if str(j) in rep:
                _unstack_item(x, rep[str(j)], offset + r * item.period, out)


def unstack_layers(tree: Mapping[str, Any], plan: Sequence[Item]) -> dict:
    """The inverse of :func:`stack_layers`: ``tree['layers'][i]`` per layer, in layer order."""
    layers = tree.get("layers")
    if layers is None:
        return dict(tree)
    out: dict[int, Any] = {}
    for k, item in enumerate(plan):
        if k in layers:
            _unstack_item(item, layers[k], 0, out)
    return {**tree, "layers": dict(sorted(out.items()))}


def describe(plan: Sequence[Item]) -> list:
    """A JSON-able outline: a layer index, or ``{"layers": [first, last], "repeats": n, "block": [...]}``."""
    out: list = []
    for x in plan:
        if isinstance(x, int):
            out.append(x)
        else:
            out.append(
                {
                    "layers": [x.start, x.start + x.repeats * x.period - 1],
                    "repeats": x.repeats,
                    "block": describe(x.block),
                }
            )
    return out
