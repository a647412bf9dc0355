"""What the runtime's parts share to talk to other ranks: ``collectives.py`` (every collective
call, and the one place that knows their names) and ``pending.py`` (a runtime's comm context and
its one queue of pending weight updates, which every op on an owner tensor consults).

Above ``_compat/`` only: the owner tensors, the stages and the runtime all import it.
"""
