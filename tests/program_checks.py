"""What JAX traced or compiled: the residuals autodiff keeps, equations and ragged_dot equations in a jaxpr
(nested ones included), and the HLO text of every step compiled."""

from __future__ import annotations

import contextlib
import io
import re

import jax


def saved_residuals(f, *args) -> list[tuple[tuple[int, ...], str]]:
    """(shape, source) of what autodiff keeps for f's backward pass, from JAX's public printout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(f, *args)
    rows = [re.match(r"\w+\[([\d,]*)\] (.*)", line) for line in out.getvalue().splitlines()]
    assert rows and all(rows), out.getvalue()
    return [(tuple(int(d) for d in m.group(1).split(",") if d), m.group(2)) for m in rows]


def count_eqns(jaxpr) -> int:
    """Equations in a jaxpr, including those of nested jaxprs (scan bodies, pjit calls)."""
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for v in eqn.params.values():
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                n += count_eqns(inner)
    return n


def ragged_dots(jaxpr) -> int:
    """ragged_dot equations in a jaxpr and the jaxprs nested in it (custom VJPs, pjit calls)."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name.startswith("ragged_dot")
        for v in eqn.params.values():
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                n += ragged_dots(inner)
    return n


def keep_compiled_text(monkeypatch) -> list[str]:
    """The HLO text of every program ``zoo.compiled.compiler.compile_lowered`` compiles from here on (appended as each
    is compiled), for tests that read what the TPU compiler made of a step."""
    import zoo.compiled.compiler as step

    texts: list[str] = []
    compile_lowered = step.compile_lowered

    def keep(*args, **kwargs):
        compiled = compile_lowered(*args, **kwargs)
        texts.append(compiled.as_text())
        return compiled

    monkeypatch.setattr(step, "compile_lowered", keep)
    return texts
