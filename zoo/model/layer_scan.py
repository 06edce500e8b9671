"""Scanning a stack of layers: the layer sequence covered by repeated blocks (:func:`layer_segments`), one
:func:`jax.lax.scan` per block (:func:`scan_segments`), the remat policies its body may run under, and a stack's
layers sliced for a run of them (:func:`stack_slice`).

Both the training forward (:mod:`zoo.model.decoder`) and the cached forward (:mod:`zoo.model.decode`) run their
layers through these scans, so the program's size depends on the layer pattern, never on the depth.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name


@dataclass(frozen=True)
class Segment:
    """``repeats`` consecutive copies of a block of layers of the given kinds, from layer ``start``."""

    start: int
    repeats: int
    kinds: tuple[str, ...]

    @property
    def stop(self) -> int:
        """One past the last layer of the segment."""
        return self.start + self.repeats * len(self.kinds)

    def at(self, j: int, tree: Any) -> Any:
        """The segment's layers at block position j, from a tree stacked over the layers of its stack.

        A strided slice ([repeats, ...]; all of the stack when the period is 1). With a period over 1 it is
        given as a :class:`Strided` view, which :func:`scan_segments` under remat scans as one
        [repeats, period, ...] block of the stack (a reshape, no copy) and indexes in the body, without the copy
        of the stack a strided slice made (Qwen3-Next-80B's experts on 4 chips: 12 copies of 3 GiB); without remat
        it takes the strided slice before the scan, which the backward pass reads as it is.
        """
        period = len(self.kinds)
        if period == 1:
            return jax.tree.map(lambda a: a[self.start: self.stop], tree)
        return jax.tree.map(lambda a: Strided(a, self.start, self.repeats, period, j), tree)


@dataclass(frozen=True, eq=False)
class Strided:
    """``array[lo + off : lo + off + repeats * step : step]``, not yet taken: :func:`scan_segments` scans
    ``array[lo : lo + repeats * step]`` reshaped to [repeats, step, ...] and reads position ``off`` of each
    iteration's block, where a strided slice would have copied the layers it takes."""

    array: Any
    lo: int
    repeats: int
    step: int
    off: int

    def taken(self) -> Any:
        """The strided slice itself (a copy, in XLA)."""
        start = self.lo + self.off
        return self.array[start: start + self.repeats * self.step: self.step]

    def block(self) -> Any:
        """The stack's layers of the segment as [repeats, step, ...] (a contiguous slice, reshaped)."""
        a = self.array
        if self.lo or a.shape[0] != self.repeats * self.step:
            a = a[self.lo: self.lo + self.repeats * self.step]
        return a.reshape((self.repeats, self.step) + a.shape[1:])


def layer_segments(kinds: tuple[str, ...], max_period: int = 12) -> list[Segment]:
    """Cover the layer sequence with repeated blocks, greedily taking the block that covers most.

    Llama: one segment of L x (full). Gemma 2: (sliding, full) x L/2. Gemma 3
    with 26 layers: (5 sliding, full) x 4, then (sliding) x 2. Each segment is
    one scan whose body unrolls only its block, so the program size depends on
    the pattern, never on the depth.
    """
    out, i, n = [], 0, len(kinds)
    while i < n:
        best = Segment(i, 1, kinds[i : i + 1])
        for p in range(1, min(max_period, n - i) + 1):
            block = kinds[i : i + p]
            reps = 1
            while kinds[i + reps * p : i + (reps + 1) * p] == block:
                reps += 1
            if reps > 1 and reps * p > (best.stop - i):
                best = Segment(i, reps, block)
        out.append(best)
        i = best.stop
    return out


LAYER_INPUT = "layer_input"  # each layer's input x, named for remat: offload (scan_segments)
# the attention projections' outputs (q, k, v after any LoRA, and o's), named for remat: offload
# (zoo.layers.attention.qkv_heads, output_projection)
ATTENTION_PROJ = "attention_proj"

REMAT_POLICIES = {
    "full": None,  # save nothing inside a layer
    # The weight matmuls' outputs: zoo.layers.blocks.dense names them (its custom VJP hides the dot itself).
    "save_dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names("dense")),
    # MaxText's own policy for Llama-3.1-8B at 8192 tokens on v6e (benchmarks/maxtext_trillium_model_configs.py,
    # llama3_1_8b_8192: remat_policy custom, decoder_layer_input, query_proj, key_proj, value_proj and out_proj
    # offloaded): each layer's input and its attention projections' outputs copied to the host's pinned memory in
    # the forward pass and back in the backward; the MLP and attention itself recomputed. The MLP's gate and up
    # ([tokens, intermediate] each, 3.5x the width of x on Llama) are not kept anywhere: on the device they were
    # two 28 GiB buffers a chip over 32 layers, and a host holds them no better. A CPU has these memory kinds too
    # (one memory in fact): the same program runs there.
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[LAYER_INPUT, ATTENTION_PROJ],
        offload_src="device", offload_dst="pinned_host"),
}


def scan_segments(x: jax.Array, kinds: tuple[str, ...], layer_inputs: Callable[[Segment, int], Any],
                  layer: Callable[[jax.Array, Any, str], tuple[jax.Array, Any]], remat: str = "none",
                  stack: bool = False) -> tuple[jax.Array, list[tuple[Segment, Any]]]:
    """x through one stack of layers of ``kinds``: one :func:`jax.lax.scan` per segment of
    :func:`layer_segments`, whose body unrolls the segment's block, so compile time does not grow with depth.

    ``layer_inputs(seg, j)`` gives the scanned inputs of block position j
    (leading axis ``seg.repeats``: see :meth:`Segment.at`); ``layer(x, inputs,
    kind)`` runs one layer and returns (x, output). ``remat`` wraps each
    block in :func:`jax.checkpoint` with that policy (:data:`REMAT_POLICIES`).
    Returns x and, per segment, the layers' outputs: a list over block
    positions of outputs stacked over repeats, or with ``stack`` one tree
    [repeats, period, ...] (stacked inside the scan: for small per-layer
    statistics, read back in layer order by a reshape).
    """
    done = []
    for seg in layer_segments(kinds):
        # Views under remat only: there the body's weights are recomputed in the backward, never saved; without
        # remat the body's pick of a view would be saved per layer (a stacked copy of every weight), where a
        # strided slice before the scan is read by the backward as it is (tests/test_blockwise.py).
        xs, pick = _scanned([layer_inputs(seg, j) for j in range(len(seg.kinds))], views=remat != "none")

        def block(x: jax.Array, xs: Any, kinds: tuple[str, ...] = seg.kinds, pick: Callable = pick):
            outs = []
            for inputs, kind in zip(pick(xs), kinds):
                x, out = layer(checkpoint_name(x, LAYER_INPUT), inputs, kind)
                outs.append(out)
            return x, jax.tree.map(lambda *a: jnp.stack(a), *outs) if stack else outs

        if remat != "none":
            block = jax.checkpoint(block, policy=REMAT_POLICIES[remat], prevent_cse=False)
        x, outs = jax.lax.scan(block, x, xs)
        done.append((seg, outs))
    return x, done


def _scanned(positions: list, views: bool = True) -> tuple[Any, Callable[[Any], list]]:
    """The scanned inputs of a segment's block positions (trees whose leaves are arrays with a leading repeats
    axis or :class:`Strided` views) as (what the scan slices: each distinct view's [repeats, step, ...] block once,
    and the other leaves; a function from one iteration's slice of it to the positions' inputs). Without
    ``views``, each view is taken as the strided slice it stands for, before the scan."""
    leaves, tree = jax.tree.flatten(positions, is_leaf=lambda v: isinstance(v, Strided))
    if not views:
        leaves = [leaf.taken() if isinstance(leaf, Strided) else leaf for leaf in leaves]
    blocks: list = []
    seen: dict[tuple[int, int, int], int] = {}
    plan: list[tuple[bool, int, int]] = []  # (a view, its block or the plain leaf's index, its offset)
    plain: list = []
    for leaf in leaves:
        if isinstance(leaf, Strided):
            key = (id(leaf.array), leaf.lo, leaf.step)
            if key not in seen:
                seen[key] = len(blocks)
                blocks.append(leaf.block())
            plan.append((True, seen[key], leaf.off))
        else:
            plan.append((False, len(plain), 0))
            plain.append(leaf)

    def pick(xs: tuple[list, list]) -> list:
        views, rest = xs
        return jax.tree.unflatten(tree, [views[i][off] if view else rest[i] for view, i, off in plan])

    return (blocks, plain), pick


def stack_slice(tree: Any, first: int, n: int) -> Any:
    """Layers ``first`` to ``first + n`` of every array of ``tree`` stacked over a stack's layers (the whole tree,
    untouched, when that is the whole stack: a run of :attr:`ModelConfig.layer_runs` usually is)."""
    return jax.tree.map(lambda a: a if first == 0 and a.shape[0] == n else a[first:first + n], tree)
