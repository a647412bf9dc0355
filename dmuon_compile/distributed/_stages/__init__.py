"""The step's stages across ranks (``StepStage``, ``stages.py``): ``split_step.py``
(``SplitStage``: split Newton–Schulz), ``expert_shards.py`` (``ExpertReshardStage``: expert
stacks resharded to whole experts) and ``tp/`` (``TPStage``: tensor parallelism).

Above ``_compat/``, ``_comm/`` and ``_owner/``; below ``_runtime/``, which builds them.
"""
