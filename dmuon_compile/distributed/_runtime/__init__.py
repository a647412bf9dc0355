"""``DedicatedRuntime`` and its parts: ``runtime.py`` (one per model: the forward/backward
hooks), ``step.py`` (its step side: the step plan and the HSDP publishes), ``group.py`` (a hook
group: its flat buffer, unshard, reshard and reduce), ``group_profile.py`` (a hook group's
counters), ``replicate.py`` (HSDP's replicate stage).

The top room of ``distributed/``: it imports the others (and builds the stages); none imports it.
"""
