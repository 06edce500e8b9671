"""TPU topologies compiled for from this machine: their devices (through libtpu, no TPU needed) and the HBM the
compiler lets a program use on each chip."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from typing import Any

from zoo.errors import UserError

GIB = 2**30
# The probe's temporaries: a float32 [2**18, 2**18] array sorted (256 GiB, twice that while sorting), beyond any
# chip's HBM, so the compiler refuses it and says how much HBM it has.
_PROBE_SHAPE = (2**18, 2**18)
_HBM: dict[str, int] = {}  # the compiler's figure by device kind, probed once a process


def hbm_bytes(device: Any) -> int:
    """The HBM bytes a program may use on a TPU chip like ``device`` (a topology's device), by the TPU compiler's
    own figure: what it refuses a program over ("exceeds available HBM (15.75G)"), below the chip's nominal HBM
    (15.75 of a v5e's 16 GiB, 31.24 of a v6e's 32). Read from the refusal of a program no chip holds (a second
    on this machine, once per device kind), to the compiler's two decimals of a GiB."""
    kind = device.device_kind
    if kind not in _HBM:
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec

        from zoo.compiled.chip_bytes import compiler_refusal
        from zoo.compiled.compiler import compile_lowered

        one = NamedSharding(jax.sharding.Mesh([device], ("chip",)), PartitionSpec())
        probe = jax.jit(lambda key: jnp.sort(jax.random.uniform(key, _PROBE_SHAPE), axis=-1)[:1, :1],
                        in_shardings=one, out_shardings=one)
        lowered = probe.lower(jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=one))
        try:
            compile_lowered(lowered, "tpu", device_kind=kind)
            refused = None
        except Exception as e:  # the refusal this probe is for
            refused = compiler_refusal(str(e))
        if refused is None:
            raise UserError(f"--topology: the TPU compiler gave no HBM figure for device kind {kind!r}")
        _HBM[kind] = refused[1]
    return _HBM[kind]


def topology_devices(name: str, num_slices: int = 1) -> list:
    """The devices of TPU topology ``name`` (e.g. ``v5e:2x4``, ``v5p:2x2x2``), compiled for from this machine.

    libtpu's start-up lines about the host it is not on are held back, and shown only if the topology fails."""
    if importlib.util.find_spec("libtpu") is None:
        raise UserError("--compile-only needs the TPU compiler: pip install 'lmzoo[tpu]' (the libtpu wheel)")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes (pytest -n 2) may hold it too
    from jax.experimental import topologies

    from zoo.compiled.compiler import flags_libtpu_knows

    with tempfile.TemporaryFile() as held, flags_libtpu_knows():
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
