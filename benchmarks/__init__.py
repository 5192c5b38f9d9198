"""Sluice's benchmarks, one module per `sluice bench <name>` (see `benchmarks.cli` for the list).

They measure the product from outside: no package of the product imports this one. Shared here:
`server_process` (the one way a benchmark starts `sluice serve`).
"""
