"""polykv-router: session affinity and capacity-aware placement in front of engine replicas.

A session's private KV lives on one replica, so the router keeps each ``x-session-id`` on the
replica that holds it and places new sessions by each replica's admission capacity for their
pool. See ``docs/routing.md`` for the request path, ``docs/architecture.md`` for the modules.

Layering (a module imports only from its own layer or lower ones):

    pure   names, request, errors, pods, fleet, bindings, reservations, picker, verdicts,
           config
    I/O    logs, metrics, engines, kube, capacity, proxy, keycheck
    use    routing            (the request path: continuation, placement, re-home)
    entry  app, cli           (aiohttp wiring, the console script)

``polykv_api.models`` (the engine's wire contract) may be imported from any layer; nothing in
this package imports ``polykv_engine`` or ``polykv_operator``.
"""

__version__ = "0.1.0"
