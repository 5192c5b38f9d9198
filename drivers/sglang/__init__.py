"""SGLang servers as the engines behind the gateway, reached over HTTP.

`protocol` holds SGLang's native wire (the /generate body, its stream outputs, error bodies) and
the `StreamDelta` that turns cumulative or incremental stream outputs into our chunks; `client`
one server's endpoints over httpx; `polling` what the gateway knows of each server (health, load,
model facts); `prefix_tree` the approximate per-server radix tree built from routed prompts, and
`snapshot` its file; `kv_events` the precise index, fed by SGLang's ZMQ KV events; `router` which
server gets a request; `driver` the `Driver` that ties them together and fails a request over to
another server. docs/sglang.md draws the whole picture.
"""
