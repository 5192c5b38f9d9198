"""The fleet: engines in `sluice worker` processes on other hosts, reached over HTTP.

`wire` holds the gateway <-> worker messages, `membership` who is in the fleet (a static list
or Redis heartbeats), `routing` the filter every router of the fleet applies, `router` which
worker gets a request, `breaker` per-node circuit breakers, `client` one request's stream from
one worker and the token timeouts, `routed` the failover loop of every node kind (SGLang servers
are the other, in drivers/sglang), `driver` the `Driver` that ties them together.
docs/fleet.md draws the whole picture.
"""
