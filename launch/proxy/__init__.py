"""The P/D proxy: `python -m launch proxy --prefill URL... --decode URL... --port N`.

An OpenAI-compatible front for disaggregated prefill and decode (vLLM's toy proxy's request
flow): each request is first sent to a prefill server with ``kv_transfer_params:
{"do_remote_decode": true}`` and ``max_tokens: 1``; the ``kv_transfer_params`` of its answer
go with the unchanged request to a decode server, whose reply (streamed or not) is the
client's. Servers are taken round-robin. A prefill side that fails or answers without params
leaves the decode server to compute the prompt itself.
"""
