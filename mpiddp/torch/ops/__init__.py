"""The tensor-collective API: input checks and requests (``requests``), handles, the ``*_async``
calls, the blocking and differentiable collectives, and the state broadcasts
(``functions``: ``broadcast_parameters``, ``broadcast_optimizer_state``, objects)."""
