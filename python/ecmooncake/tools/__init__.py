"""Tools built on the library: things a person runs, not the connector.

Each command of ``python -m ecmooncake`` is a module here (``demo``,
``bench``, ``bench_vllm``, ``bench_hooks``, ``gpubench``, ``doctor``,
``proxy`` for ``proxy`` and ``register``, ``metadata_server``,
``tiny_model``); what they share is ``worker`` (a spawned process hosting
one object), ``harness`` (consumer and producer hosts for it), ``report``
(options and summaries of the measuring tools), ``serve`` (the server
commands' tokens and signals) and ``plot``. The library never imports this
package.
"""
