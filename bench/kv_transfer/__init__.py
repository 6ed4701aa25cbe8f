"""What moving KV between workers costs, and what routing and disaggregation buy.

    python -m bench.kv_transfer --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
    python -m bench.kv_transfer affinity --prefill URL --prefill URL2 [...]
    python -m bench.kv_transfer nice [--sizes 1024 4096] [--pairs 8]

Runs against live workers (``tandem up``), talking to them directly with the gateway's own two
legs and routing functions, so the figures are the engines' and not the gateway's. The first
form measures transfer cost, TTFT split vs colocated, prefill interference and idle CPU
(``transfer.py``); ``affinity`` measures prefix-cache hits with several prefill workers
(``affinity.py``); ``nice`` measures the decode worker's reads with NIXL's threads at nice 0
and at the value Tandem gives them, in alternating pairs (``thread_nice.py``).
``python -m bench.kv_transfer.ucx_transports`` needs no workers: NIXL READs
between two processes per UCX transport (``ucx_transports.py``), and
``python -m bench.kv_transfer.cma_ceiling`` the kernel copy under them alone, by cores and pages
(``cma_ceiling.py``).
"""
