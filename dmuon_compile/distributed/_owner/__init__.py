"""Owner tensors (a DTensor living whole on one rank) and the dedicated parameter registering one:
``tensor.py`` (``OwnerTensor``), ``meshes.py`` (the owners' one-rank meshes, process-wide),
``norms.py`` (an owner tensor's norm and clip scaling), ``init.py`` (``nn.init`` and random fills
on dedicated weights), ``holder.py`` (the class a module holding dedicated weights gets),
``param.py`` (``DedicatedParam``: one dedicated parameter's life).

Above ``_compat/`` and ``_comm/``. ``OwnerTensor`` pickles as
``dmuon_compile.distributed.OwnerTensor`` (``distributed/__init__.py`` keeps the path of older
checkpoints loadable).
"""
