"""TPU topologies compiled for from this machine: their devices (through libtpu, no TPU needed) and each chip's
HBM."""

from __future__ import annotations

import importlib.util
import os
import tempfile

from zoo.errors import UserError

GIB = 2**30
# HBM per chip by device kind (jax's device_kind of the topology's devices).
HBM_GIB = {"TPU v4": 32, "TPU v5 lite": 16, "TPU v5e": 16, "TPU v5p": 95, "TPU v5": 95, "TPU v6 lite": 32,
           "TPU v6e": 32}


def hbm_bytes(kind: str) -> int:
    """HBM bytes per chip of a TPU device kind (longest matching name first: "TPU v5 lite" before "TPU v5")."""
    for name in sorted(HBM_GIB, key=len, reverse=True):
        if kind.lower().startswith(name.lower()):
            return HBM_GIB[name] * GIB
    raise UserError(f"--topology: no HBM size known for device kind {kind!r} (known: {', '.join(HBM_GIB)})")


def topology_devices(name: str, num_slices: int = 1) -> list:
    """The devices of TPU topology ``name`` (e.g. ``v5e:2x4``, ``v5p:2x2x2``), compiled for from this machine.

    libtpu's start-up lines about the host it is not on are held back, and shown only if the topology fails."""
    if importlib.util.find_spec("libtpu") is None:
        raise UserError("--compile-only needs the TPU compiler: pip install 'lmzoo[tpu]' (the libtpu wheel)")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes (pytest -n 2) may hold it too
    from jax.experimental import topologies

    with tempfile.TemporaryFile() as held:
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)
        try:
            topo = topologies.get_topology_desc(platform="tpu", topology_name=name, num_slices=num_slices)
            error = None
        except Exception as e:  # libtpu's INVALID_ARGUMENT for a name it does not know
            error = str(e).splitlines()[0]
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    if error is not None:
        raise UserError(f"--topology {name}: {error.removeprefix('INVALID_ARGUMENT: ')} (names look like v5e:2x4, "
                        "v5p:2x2x2, v6e:16x16, v4:2x2x1)")
    return list(topo.devices)
