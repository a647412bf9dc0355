"""What the distributed runtime reads from torch's private APIs, one module per part
(docs/torch_internals.md): ``fsdp.py`` (FSDP2), ``dtensor.py`` (DTensor and DeviceMesh),
``c10d.py`` (c10d process groups), ``autograd.py`` (the autograd engine).

The lowest room of ``distributed/``: it imports no other room.
"""
