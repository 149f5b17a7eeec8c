"""The KV connector's scheduler side: disaggregated prefill and decode (P/D).

A decode engine pulls a prompt's KV from the prefill engine that computed it (the ranks move the
bytes, workers/kv_connector/); this package decides which loads run, holds the prefill side's
blocks under leases, and talks to other engine cores about those leases. Wire form:
protocol/kv_connector.py.
"""
