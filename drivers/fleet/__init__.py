"""The fleet: engines in `sluice worker` processes on other hosts, reached over HTTP.

`wire` holds the gateway <-> worker messages, `membership` who is in the fleet (a static list
or Redis heartbeats), `router` which worker gets a request, `breaker` per-worker circuit
breakers, `client` one request's stream from one worker, `driver` the `Driver` that ties them
together and fails a request over to another worker. docs/fleet.md draws the whole picture.
"""
