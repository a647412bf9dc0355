"""The training demo (the README's "main job"): a byte-level GPT on the Python stdlib sources.

``python -m dmuon_compile.train`` trains in one process; ``torchrun --nproc_per_node 2 -m
dmuon_compile.train`` trains with ``dedicate_params`` + FSDP2 + ``Muon`` over 2 ranks (gloo on
CPU, NCCL on GPU). See :mod:`dmuon_compile.train.cli` for the flags.

Modules: ``data`` (corpus, split, window sampler), ``model`` (the GPT), ``runtime`` (process
group, device, wrapping), ``loop`` (one training run), ``metrics`` (timers, progress, CSV,
plot, breakdown), ``cli`` (argument parsing and the driver).
"""

from dmuon_compile.train.cli import main

__all__ = ["main"]
