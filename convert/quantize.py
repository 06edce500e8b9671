"""`zoo quantize`: store a zoo checkpoint's projections quantized (NF4 or int8), once, for QLoRA bases.

The output is a zoo checkpoint in the layout :mod:`zoo.checkpoints.quantized` describes: ``zoo.load`` and ``zoo
export`` read it dequantized, and a LoRA run with it as ``model.path`` trains on the stored fields as they are
(QLoRA, no re-quantization at load). The source is read one layer at a time (:func:`zoo.checkpoints.loading.param_reader`:
a converted checkpoint, a training run's ``final``, an adapter checkpoint merged), so memory holds one float
layer and one projection's fields.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from convert.mtp import EXTRA_FILE
from zoo.checkpoints import quantized as quant_checkpoint
from zoo.checkpoints.format import HF_CONFIG_FILE, TOKENIZER_DIR, read_meta
from zoo.checkpoints.loading import param_reader, quantized_param
from zoo.checkpoints.provenance import provenance_of
from zoo.checkpoints.writer import CheckpointWriter, atomic_output
from zoo.errors import UserError
from zoo.model import quant
from zoo.model.config import ModelConfig
from zoo.model.params import param_specs


def quantize_checkpoint(src: str | Path, out: str | Path, kind: str = "nf4", double: bool = False,
                        progress: bool | None = None) -> tuple[Path, float]:
    """Write ``src`` with every :func:`zoo.model.quant.quantized_paths` projection quantized into ``out``;
    returns (the output folder, bits per quantized parameter as stored)."""
    from tqdm import tqdm

    if kind not in quant.KINDS:
        raise UserError(f"--quant {kind}: choose one of {', '.join(quant.KINDS)}")
    if double and kind != "nf4":
        raise UserError("--double-quant applies to --quant nf4 only")
    src = Path(src)
    meta = read_meta(src)
    already = quant_checkpoint.settings(meta)
    if already is not None:
        raise UserError(f"{src} is already stored quantized ({quant_checkpoint.describe(*already)}); "
                        "quantize the float checkpoint it came from instead")
    cfg = ModelConfig.from_dict(meta["config"])
    specs = param_specs(cfg)
    proj = quant.quantized_paths(cfg)
    with atomic_output(out) as folder:
        writer = CheckpointWriter(folder)
        for path in (p for p in specs if p not in proj):
            writer.add(path, param_reader(src, path).read(), specs[path].axes)
        nbytes = 0
        for path in tqdm(list(proj), desc=f"quantize ({quant_checkpoint.describe(kind, double)})", unit="param",
                         disable=None if progress is None else not progress):
            qw = quantized_param(src, path, kind, double)  # one float matrix (layer, expert) at a time
            lead = len(qw.lead)
            for name, array in qw.data.items():
                nbytes += array.nbytes
                writer.add(f"{path}.{name}", array, specs[path].axes[:lead] + (None,) * (array.ndim - lead))
            del qw
        params = sum(int(np.prod(specs[p].shape)) for p in proj)
        bits = 8 * nbytes / params
        stored = dict(writer.params)
        for name in (TOKENIZER_DIR,):
            if (src / name).is_dir():
                shutil.copytree(src / name, folder / name)
        for name in (HF_CONFIG_FILE, EXTRA_FILE):
            if (src / name).is_file():
                shutil.copyfile(src / name, folder / name)
        section = quant_checkpoint.QuantSection(kind=kind, double=double, bits_per_param=round(bits, 4), params=stored)
        writer.finish(cfg, manifest=meta["params"], source=str(src.absolute()), source_format="quantize",
                      **provenance_of(meta), **{quant_checkpoint.SECTION: section})
    return Path(out).absolute(), bits
