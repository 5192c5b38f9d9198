"""Sluice's benchmarks, one module per `sluice bench <name>` (`benchmarks.cli` holds the list).

They measure the service from outside, and no package of the service imports this one. Shared here:
`server_process` (the one way a benchmark starts `sluice serve`; the tests start theirs with it too),
`words` (the word list of plain-text prompts), `pressure` (what priority, prefix and spike share),
`config_options` (options from a frozen config, and a report's closing lines: fleet*, gateway);
`serve_prompts` and `serve_metrics` are the halves of `sluice bench serve` that others reuse.
"""
