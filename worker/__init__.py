"""`sluice worker`: engine nodes served to the fleet over HTTP (docs/fleet.md).

`settings` is its frozen config, `app` the ASGI app (the fleet wire of `drivers.fleet.wire`),
`server` uvicorn with SIGTERM drain and the Redis heartbeat, `cli` the command's flags.
"""
