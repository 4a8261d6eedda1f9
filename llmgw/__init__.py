"""llmgw: run open-weight LLMs on a GPU fleet behind one OpenAI-compatible endpoint.

One executable, three roles (``llmgw server``, ``llmgw agent``, ``llmgw ctl``). The packages, from
the top down; each imports only packages below it (``tests/test_layers.py`` fails on anything else):

- ``cli``: the subcommands; starts a role.
- ``ctl``: the operator's CLI, one module per noun, each owning its parser; uses the gateway's HTTP
  stream for ``bench``. Never imports ``server`` or ``agent``.
- ``server``: the control plane's shells: store (sqlite.py the only apsw importer, postgres.py psycopg's), node registry and link
  listener, admin API, catalog, the reconciler's shell (replicas), the gateway's gate, engine
  scrapes, the usage book, tenants, jobs. Never imports ``agent``.
- ``agent``: discovery (the only pynvml importer), the link client, the shard supervisor, the
  trainer and its child (the only torch/peft/transformers importer). Never imports ``server``.
- ``config``: server.yaml and agent.yaml as attrs classes whose errors name the field.
- ``wire``: the agent↔server messages, their codec, the HTTP/2 stream, files cut into pieces.
- ``gateway``: the data plane (listener, relay, stream pump, upstream pools) and, in
  ``gateway.contract``, what the control plane implements for it. Imports no other llmgw package
  but ``core`` and ``tracing`` (its request spans).
- ``http_probe``: one GET to an engine, for the agent's readiness checks and the server's scrapes.
- ``procfs``: a process's /proc stat (state, start time), for the agent's engines and the server's
  gateway workers alike.
- ``core``: every decision, pure (``now`` is a parameter; no I/O, no clock, no event loop), and the
  facts it decides on; a leaf: it imports no other llmgw package.
"""

__version__ = "0.1.0"
